"""Explicit inference caches: conv + SSM state per Mamba layer, keys/values per attention layer.

Every tensor keeps a leading batch dimension, and the sequence length is a per-row device tensor,
so rows that accept different numbers of tokens can share one cache.

Deferred replay (`ModelCache.enable_pending`): a greedy tree iteration on the kernels may leave
the SSM states one accepted path behind and keep that path's SSM inputs in pending buffers
instead of advancing every state at once (a read and a write of every state). The next verify's
tree scan, which reads each state anyway, applies the pending steps, writes the state back and
scans from it. Every other reader of the states settles the cache first
(`LanguageModel.settle_cache`): `pending_maybe` is the host-side flag that says it may have to.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MambaLayerCache:
    conv_state: torch.Tensor
    """(B, C, K-1) the last K-1 pre-conv inputs, oldest first."""
    ssm_state: torch.Tensor
    """(B, H, P, S) fp32."""
    pending_x: torch.Tensor | None = None
    """(B, M, H, P): the SSM inputs x of the steps not yet in ssm_state (deferred replay), or None."""
    pending_dt: torch.Tensor | None = None
    """(B, M, H) fp32: their time steps."""
    pending_B: torch.Tensor | None = None
    """(B, M, G, S): their B."""

    @property
    def pending(self) -> tuple | None:
        """(x, dt, B) pending buffers, or None."""
        return None if self.pending_x is None else (self.pending_x, self.pending_dt, self.pending_B)

    def select(self, rows: torch.Tensor) -> "MambaLayerCache":
        if self.pending_x is None:
            return MambaLayerCache(self.conv_state[rows], self.ssm_state[rows])
        return MambaLayerCache(self.conv_state[rows], self.ssm_state[rows], self.pending_x[rows],
                               self.pending_dt[rows], self.pending_B[rows])

    def copy_(self, other: "MambaLayerCache") -> None:
        if (self.pending_x is None) != (other.pending_x is None):
            raise ValueError("copy_: one cache has deferred-replay buffers and the other not (settle or enable both)")
        for name, t in vars(self).items():
            if t is not None:
                t.copy_(getattr(other, name))


@dataclass
class AttentionLayerCache:
    keys: torch.Tensor
    """(B, Hkv, T_max, D) after RoPE; entries at or past the row's length are garbage."""
    values: torch.Tensor
    """(B, Hkv, T_max, D)."""

    def select(self, rows: torch.Tensor) -> "AttentionLayerCache":
        return AttentionLayerCache(self.keys[rows], self.values[rows])

    def copy_(self, other: "AttentionLayerCache") -> None:
        self.keys.copy_(other.keys)
        self.values.copy_(other.values)


@dataclass
class ModelCache:
    layers: list
    """One MambaLayerCache, AttentionLayerCache or None (MLP) per sublayer."""
    seqlen: torch.Tensor
    """(B,) int64 tokens already in the cache for each row."""
    pending_len: torch.Tensor | None = None
    """(B,) int32 steps each row's SSM states are behind (deferred replay), or None: never deferred."""
    pending_maybe: bool = False
    """Host side: whether pending_len may be nonzero (a deferred replay ran since the last settle)."""

    @property
    def batch_size(self) -> int:
        return self.seqlen.shape[0]

    def select(self, rows: torch.Tensor) -> "ModelCache":
        """A new cache whose row r is a copy of row rows[r] (used to branch a drafter per tree node)."""
        return ModelCache([None if c is None else c.select(rows) for c in self.layers], self.seqlen[rows].clone(),
                          None if self.pending_len is None else self.pending_len[rows].clone(), self.pending_maybe)

    def copy_(self, other: "ModelCache") -> None:
        if (self.pending_len is None) != (other.pending_len is None):
            raise ValueError("copy_: one cache has deferred-replay buffers and the other not (settle or enable both)")
        for mine, theirs in zip(self.layers, other.layers):
            if mine is not None:
                mine.copy_(theirs)
        self.seqlen.copy_(other.seqlen)
        if self.pending_len is not None:
            self.pending_len.copy_(other.pending_len)
        self.pending_maybe = other.pending_maybe

    def enable_pending(self, steps: int) -> bool:
        """Give every Mamba layer pending buffers for deferred replays of up to `steps` steps
        (kept if already there with at least that many). Returns whether the cache has them
        now: buffers once captured by a graph are never reallocated, so a longer path than the
        existing buffers hold gets False (replay it the ordinary way)."""
        if self.pending_len is not None:
            mamba = [c for c in self.layers if isinstance(c, MambaLayerCache)]
            return not mamba or mamba[0].pending_x.shape[1] >= steps
        batch = self.batch_size
        for c in self.layers:
            if isinstance(c, MambaLayerCache):
                _, heads, head_dim, d_state = c.ssm_state.shape
                groups_s = c.conv_state.shape[1] - heads * head_dim  # 2 G S channels after x
                dev, dtype = c.ssm_state.device, c.conv_state.dtype
                c.pending_x = torch.zeros(batch, steps, heads, head_dim, device=dev, dtype=dtype)
                c.pending_dt = torch.zeros(batch, steps, heads, device=dev, dtype=torch.float32)
                c.pending_B = torch.zeros(batch, steps, groups_s // (2 * d_state), d_state, device=dev, dtype=dtype)
        self.pending_len = torch.zeros(batch, dtype=torch.int32, device=self.seqlen.device)
        return True

    def reset_(self) -> None:
        """Empty the cache in place (tensors keep their storage, so captured graphs stay valid)."""
        for layer in self.layers:
            if layer is None:
                continue
            for t in vars(layer).values():
                if t is not None:
                    t.zero_()
        self.seqlen.zero_()
        if self.pending_len is not None:
            self.pending_len.zero_()
        self.pending_maybe = False

    def clone(self) -> "ModelCache":
        return self.select(torch.arange(self.batch_size, device=self.seqlen.device))
