"""Mixture-of-experts feed-forward sublayer: per-token top-k routing, gated experts, a shared expert.

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
    """E gated experts as stacked weights (transformers' layout: gate and up rows in one tensor)."""

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.act = ACTIVATIONS[cfg.activation]
        self.gate_up_proj = nn.Parameter(torch.empty(cfg.n_experts, 2 * cfg.d_intermediate, d_model))  # (E, 2I, D)
        self.down_proj = nn.Parameter(torch.empty(cfg.n_experts, d_model, cfg.d_intermediate))  # (E, D, I)

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

    def _hidden(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
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
            y = F.linear(self._hidden(F.linear(x[rows], self.gate_up_proj[e])), self.down_proj[e])
            out.index_add_(0, rows, (y * slot_weights[pairs, None]).to(out.dtype))
        return out

    def gathered(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward` without a host read: each (row, slot) pair multiplies by its own expert's
        weights, gathered (M*k expert matrices: for few pairs)."""
        M, k = experts.shape
        flat = experts.flatten()
        rows = x.repeat_interleave(k, dim=0)[:, :, None]  # (M*k, D, 1)
        hidden = self._hidden(torch.bmm(self.gate_up_proj[flat], rows)[..., 0])  # (M*k, I)
        y = torch.bmm(self.down_proj[flat], hidden[:, :, None])[..., 0]  # (M*k, D)
        return (y.view(M, k, -1) * weights[..., None]).sum(1).to(x.dtype)

    def dense(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """`forward` without a host read: every expert over every row (each expert's weights read
        once), then each row's k outputs picked and weighted (for many pairs)."""
        M = x.shape[0]
        hidden = self._hidden(torch.matmul(x, self.gate_up_proj.transpose(1, 2)))  # (E, M, I)
        every = torch.bmm(hidden, self.down_proj.transpose(1, 2))  # (E, M, D)
        picked = every[experts, torch.arange(M, device=x.device)[:, None]]  # (M, k, D)
        return (picked * weights[..., None]).sum(1).to(x.dtype)


class MoE(nn.Module):
    """router -> top-k experts (softmax over the chosen logits) + shared expert."""

    def __init__(self, d_model: int, cfg: MoEConfig):
        super().__init__()
        if cfg.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MoE activation {cfg.activation!r}; one of {sorted(ACTIVATIONS)}")
        self.cfg = cfg
        self.router = nn.Linear(d_model, cfg.n_experts, bias=False)
        self.experts = Experts(d_model, cfg)
        self.shared = (MLP(d_model, MLPConfig(cfg.shared_intermediate, gated=True, activation=cfg.activation))
                       if cfg.shared_intermediate else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (M, D) -> (weights (M, k) in x's dtype, experts (M, k)); the softmax runs in fp32."""
        logits = F.linear(x, self.router.weight).float()  # (M, E)
        top, experts = logits.topk(self.cfg.top_k, dim=-1)
        return torch.softmax(top, dim=-1).to(x.dtype), experts

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, D) -> (B, T, D); the same function for a sequence, one token or a packed tree."""
        x = h.reshape(-1, h.shape[-1])  # (B*T, D)
        weights, experts = self.route(x)
        out = self.experts(x, experts, weights)
        if self.shared is not None:
            out = out + self.shared(x)
        return out.view(h.shape)
