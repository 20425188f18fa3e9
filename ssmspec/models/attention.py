"""Attention with GQA and optional partial RoPE, over a preallocated KV cache, with a tree path."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..ops import dispatch
from .cache import AttentionLayerCache
from .config import AttentionConfig

ATTENTION_SCORE_ELEMENTS = 1 << 24
"""Most attention scores (B x H x queries x keys) one call holds; a longer full-sequence pass
attends in chunks of queries, so a prompt's memory grows linearly with its length, not as T x T."""
MIN_QUERY_CHUNK = 16
"""Fewest queries per chunk (fewer calls); passes this short are never chunked."""


def _project_rows(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x), through the decode kernels (GEMV / skinny GEMM, ops/gemv) at inference: at a
    few rows they stream the weights faster than cuBLAS. Training keeps nn.Linear (autograd)."""
    if torch.is_grad_enabled():
        return linear(x)
    return dispatch.linear(x, linear.weight, linear.bias)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@dataclass
class AttentionTreeActivations:
    keys: torch.Tensor  # (B, Hkv, N, D) after RoPE
    values: torch.Tensor  # (B, Hkv, N, D)


def write_kv(cache: AttentionLayerCache, seqlen: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             count: torch.Tensor | None = None, check: bool = True) -> None:
    """Write k, v (B, Hkv, M, D) at each row's positions seqlen .. seqlen+M-1 (the first `count` valid).

    check=False skips the capacity check, one device read: for callers that checked the same
    positions already (every layer of one call shares them)."""
    batch, _, steps, _ = k.shape
    capacity = cache.keys.shape[2]
    pos = seqlen[:, None] + torch.arange(steps, device=k.device)[None, :]  # (B, M)
    if count is not None:
        # Invalid entries rewrite the row's last slot with what is already there.
        valid = torch.arange(steps, device=k.device)[None, :] < count[:, None]
        pos = torch.where(valid, pos, capacity - 1)
        rows = torch.arange(batch, device=k.device)[:, None]
        keep = valid[:, None, :, None]
        k = torch.where(keep, k, cache.keys[rows, :, pos].transpose(1, 2))
        v = torch.where(keep, v, cache.values[rows, :, pos].transpose(1, 2))
    # The check reads a device value on the host, which CUDA-graph capture forbids; captured
    # callers (profiling, decoding graphs) allocate the capacity they need beforehand.
    if check and not (k.is_cuda and torch.cuda.is_current_stream_capturing()) and int(pos.max()) >= capacity:
        raise RuntimeError(f"KV cache of {capacity} positions is full; allocate a larger cache (max_len)")
    index = pos[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
    cache.keys.scatter_(2, index, k.to(cache.keys.dtype))
    cache.values.scatter_(2, index, v.to(cache.values.dtype))


class Attention(nn.Module):
    """q/k/v/o projections (transformers naming). Positions come from the cache's per-row length."""

    def __init__(self, d_model: int, cfg: AttentionConfig, d_in: int | None = None):
        """d_in: width of the input when it is not d_model (Zamba2's shared blocks read 2 * d_model)."""
        super().__init__()
        self.cfg = cfg
        d_in = d_in or d_model
        self.q_proj = nn.Linear(d_in, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d_in, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d_in, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, d_model, bias=cfg.out_bias)
        if cfg.rotary_dim:
            if torch.get_default_device().type == "meta":
                # loading.allocate.empty_model rebuilds it; arithmetic on meta tensors would import
                # torch._dynamo (about 2 s of every command that loads a hybrid model)
                inv_freq = torch.empty((cfg.rotary_dim + 1) // 2)
            else:
                inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float32) / cfg.rotary_dim))
            self.register_buffer("inv_freq", inv_freq, persistent=False)

    def new_cache(self, batch: int, max_len: int, device, dtype) -> AttentionLayerCache:
        shape = (batch, self.cfg.n_kv_heads, max_len, self.cfg.head_dim)
        return AttentionLayerCache(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    def _rope(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """t (B, heads, N, D), positions (B, N)."""
        rd = self.cfg.rotary_dim
        if not rd:
            return t
        freqs = positions[:, None, :, None].float() * self.inv_freq  # (B, 1, N, rd/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(t.dtype), emb.sin().to(t.dtype)
        rot, rest = t[..., :rd], t[..., rd:]
        return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)

    def _project(self, h: torch.Tensor, positions: torch.Tensor, adapters=None):
        """q, k, v (B, heads, N, D) after RoPE; adapters: (q, k, v) modules whose outputs are
        added to the projections (a Zamba2 shared block's per-use adapters), or None."""
        c = self.cfg
        q, k, v = (_project_rows(proj, h) for proj in (self.q_proj, self.k_proj, self.v_proj))
        if adapters is not None:
            q, k, v = q + adapters[0](h), k + adapters[1](h), v + adapters[2](h)
        q = q.unflatten(-1, (c.n_heads, c.head_dim)).transpose(1, 2)  # (B, H, N, D)
        k = k.unflatten(-1, (c.n_kv_heads, c.head_dim)).transpose(1, 2)
        v = v.unflatten(-1, (c.n_kv_heads, c.head_dim)).transpose(1, 2)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(self, q, k_new, v_new, cache, seqlen, new_mask):
        """Attention of new queries to the cached prefix (per-row length) plus the new keys.

        new_mask: (N, N) bool, which new keys each new query may see (causal or tree mask).
        """
        batch, n = q.shape[0], q.shape[2]
        if cache is None:
            keys, values = k_new, v_new
            mask = new_mask[None].expand(batch, n, n)
        else:
            keys = torch.cat([cache.keys, k_new], dim=2)
            values = torch.cat([cache.values, v_new], dim=2)
            capacity = cache.keys.shape[2]
            prefix = torch.arange(capacity, device=q.device)[None, :] < seqlen[:, None]  # (B, T_max)
            mask = torch.cat([prefix[:, None, :].expand(batch, n, capacity), new_mask[None].expand(batch, n, n)], dim=-1)
        groups = self.cfg.n_heads // self.cfg.n_kv_heads
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], scale=self.cfg.scale)
        return _project_rows(self.o_proj, out.transpose(1, 2).flatten(-2))

    def forward(self, h: torch.Tensor, cache: AttentionLayerCache | None = None, seqlen: torch.Tensor | None = None,
                adapters=None):
        """Causal attention over h (B, T, D) after the cached prefix; writes the new keys/values.
        adapters: see `_project`."""
        batch, steps = h.shape[:2]
        if seqlen is None:
            seqlen = torch.zeros(batch, dtype=torch.long, device=h.device)
        positions = seqlen[:, None] + torch.arange(steps, device=h.device)[None, :]
        q, k, v = self._project(h, positions, adapters)
        keys = steps + (0 if cache is None else cache.keys.shape[2])
        # Inference only: under autograd each chunk's probabilities are kept for the backward
        # anyway (and the GPU's fused kernels never hold the scores). A single step (what CUDA
        # graphs capture) holds one row of scores: never chunked.
        if (not torch.is_grad_enabled() and steps > MIN_QUERY_CHUNK
                and batch * self.cfg.n_heads * steps * keys > ATTENTION_SCORE_ELEMENTS):
            return self._attend_in_chunks(q, k, v, cache, seqlen)
        causal = torch.ones(steps, steps, dtype=torch.bool, device=h.device).tril()
        out = self._attend(q, k, v, cache, seqlen, causal)
        if cache is not None:
            write_kv(cache, seqlen, k, v)
        return out

    def _attend_in_chunks(self, q, k, v, cache, seqlen):
        """Causal attention of q (B, H, T, D) in chunks of queries: the same function as `_attend`
        with a causal mask, holding one chunk's scores at a time instead of all T x (cache + T).

        With a cache, the new keys are written first; each query then sees the cache up to its
        own position (the prefix and the new keys before it)."""
        batch, _, steps, _ = q.shape
        device = q.device
        if cache is None:
            keys, values = k, v
            query_pos = torch.arange(steps, device=device)[None, :].expand(batch, steps)  # (B, T)
            offset = 0
        else:
            write_kv(cache, seqlen, k, v)
            offset = int(seqlen.max())  # host read: never captured (graphs run T=1 steps and trees)
            keys = cache.keys[:, :, :offset + steps].to(q.dtype)
            values = cache.values[:, :, :offset + steps].to(q.dtype)
            query_pos = seqlen[:, None] + torch.arange(steps, device=device)[None, :]
        groups = self.cfg.n_heads // self.cfg.n_kv_heads
        keys = keys.repeat_interleave(groups, dim=1)  # (B, H, L, D), once for all chunks
        values = values.repeat_interleave(groups, dim=1)
        key_pos = torch.arange(keys.shape[2], device=device)
        chunk = max(MIN_QUERY_CHUNK, ATTENTION_SCORE_ELEMENTS // (batch * self.cfg.n_heads * keys.shape[2]))
        out = []
        for start in range(0, steps, chunk):
            end = min(start + chunk, steps)
            reach = offset + end  # no query of this chunk sees a key past it
            mask = key_pos[None, None, :reach] <= query_pos[:, start:end, None]  # (B, c, reach)
            out.append(F.scaled_dot_product_attention(q[:, :, start:end], keys[:, :, :reach], values[:, :, :reach],
                                                      attn_mask=mask[:, None], scale=self.cfg.scale))
        out = torch.cat(out, dim=2)  # (B, H, T, D)
        return _project_rows(self.o_proj, out.transpose(1, 2).flatten(-2))

    def step(self, h: torch.Tensor, cache: AttentionLayerCache, seqlen: torch.Tensor, adapters=None):
        return self.forward(h, cache, seqlen, adapters)

    def verify(self, h, cache, seqlen, depth, tree_mask, adapters=None):
        """Attention of the packed tree nodes under the tree mask; writes nothing.

        Args:
            h: (B, N, D); depth: (N,) node depths (root 0); tree_mask: (N, N) bool ancestor mask.
        """
        positions = seqlen[:, None] + depth[None, :]  # RoPE follows depth, not packed index
        q, k, v = self._project(h, positions, adapters)
        return self._attend(q, k, v, cache, seqlen, tree_mask), AttentionTreeActivations(k, v)

    def replay(self, cache, acts: AttentionTreeActivations, seqlen, path, path_len):
        """Keep exactly the accepted path's keys and values, in order, after the prefix."""
        rows = torch.arange(path.shape[0], device=path.device)[:, None]
        k = acts.keys.transpose(1, 2)[rows, path].transpose(1, 2)  # (B, Hkv, M, D)
        v = acts.values.transpose(1, 2)[rows, path].transpose(1, 2)
        write_kv(cache, seqlen, k, v, count=path_len)
