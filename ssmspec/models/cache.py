"""Explicit inference caches: conv + SSM state per Mamba layer, keys/values per attention layer.

Every tensor keeps a leading batch dimension, and the sequence length is a per-row device tensor,
so rows that accept different numbers of tokens can share one cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PendingPath:
    """Accepted paths whose SSM-state update is deferred (see `ModelCache.pending_len`): their
    nodes' SSM inputs, fp32, in decoding order, several iterations' paths one after another, up
    to M entries. The conv state is never deferred."""

    x: torch.Tensor
    """(B, M, H, P)."""
    dt: torch.Tensor
    """(B, M, H)."""
    B: torch.Tensor
    """(B, M, G, S)."""

    def select(self, rows: torch.Tensor) -> "PendingPath":
        return PendingPath(self.x[rows], self.dt[rows], self.B[rows])

    def copy_(self, other: "PendingPath") -> None:
        self.x.copy_(other.x)
        self.dt.copy_(other.dt)
        self.B.copy_(other.B)


@dataclass
class MambaLayerCache:
    conv_state: torch.Tensor
    """(B, C, K-1) the last K-1 pre-conv inputs, oldest first."""
    ssm_state: torch.Tensor
    """(B, H, P, S) fp32."""
    pending: PendingPath | None = None
    """With deferred replay (`ModelCache.pending_len`), the accepted paths not yet in ssm_state."""

    def select(self, rows: torch.Tensor) -> "MambaLayerCache":
        return MambaLayerCache(self.conv_state[rows], self.ssm_state[rows],
                               None if self.pending is None else self.pending.select(rows))

    def copy_(self, other: "MambaLayerCache") -> None:
        if (self.pending is None) != (other.pending is None):
            raise ValueError("copy_: the caches do not defer their replay alike")
        self.conv_state.copy_(other.conv_state)
        self.ssm_state.copy_(other.ssm_state)
        if self.pending is not None:
            self.pending.copy_(other.pending)


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
    """Deferred replay (`LanguageModel.enable_deferred_replay`), else None: (B,) int64, how many
    entries of each Mamba layer's `pending` paths are not yet in its SSM state; the state a layer
    stands for is ssm_state advanced over them. `replay` appends the accepted path there instead
    of writing the state. The next `verify`'s tree scan, which reads the state anyway, applies
    the entries in registers before its wait on the kernels before it, and writes the advanced
    state back only when the next path might not fit (`pending_reserve`): so the state's fp32
    write, the replay's cost, is paid once per several iterations."""
    pending_reserve: int = 0
    """The widest path `replay` defers (a tree's depth + 1): a verify writes the advanced state
    back, and empties the pending entries, when fewer than this many would be left free."""

    @property
    def batch_size(self) -> int:
        return self.seqlen.shape[0]

    def select(self, rows: torch.Tensor) -> "ModelCache":
        """A new cache whose row r is a copy of row rows[r] (used to branch a drafter per tree node)."""
        return ModelCache([None if c is None else c.select(rows) for c in self.layers], self.seqlen[rows].clone(),
                          None if self.pending_len is None else self.pending_len[rows].clone(), self.pending_reserve)

    def copy_(self, other: "ModelCache") -> None:
        if (self.pending_len is None) != (other.pending_len is None) or self.pending_reserve != other.pending_reserve:
            raise ValueError("copy_: the caches do not defer their replay alike")
        for mine, theirs in zip(self.layers, other.layers):
            if mine is not None:
                mine.copy_(theirs)
        self.seqlen.copy_(other.seqlen)
        if self.pending_len is not None:
            self.pending_len.copy_(other.pending_len)

    def reset_(self) -> None:
        """Empty the cache in place (tensors keep their storage, so captured graphs stay valid)."""
        for layer in self.layers:
            if layer is not None:
                for t in _tensors(layer):
                    t.zero_()
        self.seqlen.zero_()
        if self.pending_len is not None:
            self.pending_len.zero_()

    def clone(self) -> "ModelCache":
        return self.select(torch.arange(self.batch_size, device=self.seqlen.device))


def _tensors(obj) -> list[torch.Tensor]:
    """Every tensor of a layer cache, its pending path's included."""
    out = []
    for value in vars(obj).values():
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, PendingPath):
            out.extend(_tensors(value))
    return out
