"""Mixture-of-experts feed-forward sublayer: per-token top-k routing, experts, a shared expert.

Routing is per token (each row's experts and weights depend on that row alone), so a packed
tree's nodes are just more tokens: `verify` runs the same function as `forward` on them and a
node's output equals the one it gets when its path is decoded alone. Nothing is cached.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops.gemv.naive import ACTIVATIONS
from .config import MLPConfig, MoEConfig
from .mlp import MLP


class Experts(nn.Module):
    """E experts as stacked weights, in transformers' layout: gated experts keep their gate and up
    rows in one tensor (gate_up_proj), plain ones have up_proj."""

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.act = ACTIVATIONS[cfg.activation]
        rows = (2 if cfg.gated else 1) * cfg.d_intermediate
        w_in = nn.Parameter(torch.empty(cfg.n_experts, rows, d_model))  # (E, 2I or I, D)
        if cfg.gated:
            self.gate_up_proj = w_in
        else:
            self.up_proj = w_in
        self.down_proj = nn.Parameter(torch.empty(cfg.n_experts, d_model, cfg.d_intermediate))  # (E, D, I)

    @property
    def w_in(self) -> torch.Tensor:
        return self.gate_up_proj if self.cfg.gated else self.up_proj

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each row's k experts of weight * expert(row): the same function three ways.

        Eagerly, each expert hit runs once over its rows (`by_expert`, as transformers does).
        Under CUDA-graph capture (the decode loop's steps, tree iterations and chunked prefill),
        which forbids the host read that grouping rows by expert needs, the rows go without one:
        `gathered` (each (row, slot) pair reads its own expert's weights) while there are fewer
        pairs than experts, as in one-token steps; `dense` (every expert over every row, then
        each row's k picked) from there on, as in tree verification, where the pairs hit most
        experts anyway and every expert's weights are read once.

        Args:
            x: (M, D) rows; experts: (M, k) int64 expert of each (row, slot); weights: (M, k).
        Returns:
            (M, D).
        """
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self.by_expert(x, experts, weights)
        if experts.numel() < self.cfg.n_experts:
            return self.gathered(x, experts, weights)
        return self.dense(x, experts, weights)

    def _hidden(self, projected: torch.Tensor) -> torch.Tensor:
        if not self.cfg.gated:
            return self.act(projected)
        gate, up = projected.chunk(2, dim=-1)
        return self.act(gate) * up

    def by_expert(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward` with the pairs grouped by expert: one GEMM per expert hit, however many
        trees, batch rows or prompt tokens its rows come from; experts added in expert order.
        Reads the per-expert counts on the host (not capturable)."""
        k = experts.shape[1]
        flat = experts.flatten()  # (M*k,) (row, slot) pairs, row-major
        order = flat.argsort(stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.cfg.n_experts).tolist()
        slot_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            rows = pairs // k
            y = F.linear(self._hidden(F.linear(x[rows], self.w_in[e])), self.down_proj[e])
            out.index_add_(0, rows, (y * slot_weights[pairs, None]).to(out.dtype))
        return out

    def gathered(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward` without a host read: each (row, slot) pair multiplies by its own expert's
        weights, gathered (M*k expert matrices: for few pairs)."""
        M, k = experts.shape
        flat = experts.flatten()
        rows = x.repeat_interleave(k, dim=0)[:, :, None]  # (M*k, D, 1)
        hidden = self._hidden(torch.bmm(self.w_in[flat], rows)[..., 0])  # (M*k, I)
        y = torch.bmm(self.down_proj[flat], hidden[:, :, None])[..., 0]  # (M*k, D)
        return (y.view(M, k, -1) * weights[..., None]).sum(1).to(x.dtype)

    def dense(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward` without a host read: every expert over every row (each expert's weights read
        once), then each row's k outputs picked and weighted (for many pairs)."""
        M = x.shape[0]
        hidden = self._hidden(torch.matmul(x, self.w_in.transpose(1, 2)))  # (E, M, I)
        every = torch.bmm(hidden, self.down_proj.transpose(1, 2))  # (E, M, D)
        picked = every[experts, torch.arange(M, device=x.device)[:, None]]  # (M, k, D)
        return (picked * weights[..., None]).sum(1).to(x.dtype)


class MoE(nn.Module):
    """router -> top-k experts (optionally at a latent width) + shared expert."""

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        if cfg.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MoE activation {cfg.activation!r}; one of {sorted(ACTIVATIONS)}")
        self.cfg = cfg
        self.router = nn.Linear(d_model, cfg.n_experts, bias=False)
        if cfg.router == "sigmoid":
            self.score_bias = nn.Parameter(torch.zeros(cfg.n_experts))
            """Added to the sigmoid scores to choose the experts, not to weight them (e_score_correction_bias)."""
        if cfg.latent_size:
            self.fc1_latent_proj = nn.Linear(d_model, cfg.latent_size, bias=False)
            self.fc2_latent_proj = nn.Linear(cfg.latent_size, d_model, bias=False)
        self.experts = Experts(cfg.latent_size or d_model, cfg)
        self.shared = (MLP(d_model, MLPConfig(cfg.shared_intermediate, gated=cfg.gated, activation=cfg.activation))
                       if cfg.shared_intermediate else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, D) -> (weights (M, k), experts (M, k)), from row alone.

        softmax: the softmax of the top-k router logits (in fp32, then x's dtype). sigmoid: the
        top-k of score + bias among the rows' topk_group best groups (a group ranks by its two
        best), weighted by the plain scores, normalised if norm_topk_prob, times routed_scaling
        (in fp32)."""
        c = self.cfg
        if c.router == "softmax":
            logits = F.linear(x, self.router.weight).float()  # (M, E)
            top, experts = logits.topk(c.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype), experts
        scores = F.linear(x.float(), self.router.weight.float()).sigmoid()  # (M, E)
        choice = scores + self.score_bias.float()
        groups = choice.view(-1, c.n_group, c.n_experts // c.n_group)  # (M, G, E/G)
        best_groups = groups.topk(min(2, groups.shape[-1]), dim=-1).values.sum(-1).topk(c.topk_group, dim=-1).indices
        keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)  # (M, G)
        choice = choice.masked_fill(~keep[..., None].expand_as(groups).reshape_as(choice), float("-inf"))
        experts = choice.topk(c.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * c.routed_scaling, experts

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, D) -> (B, T, D); the same function for a sequence, one token or a packed tree."""
        x = h.reshape(-1, h.shape[-1])  # (B*T, D)
        weights, experts = self.route(x)
        if self.cfg.latent_size:
            out = self.fc2_latent_proj(self.experts(self.fc1_latent_proj(x), experts, weights))
        else:
            out = self.experts(x, experts, weights)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(h.shape)
