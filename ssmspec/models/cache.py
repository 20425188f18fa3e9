"""Explicit inference caches: conv + SSM state per Mamba layer, keys/values per attention layer.

Every tensor keeps a leading batch dimension, and the sequence length is a per-row device tensor,
so rows that accept different numbers of tokens can share one cache.
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

    def select(self, rows: torch.Tensor) -> "MambaLayerCache":
        return MambaLayerCache(self.conv_state[rows], self.ssm_state[rows])

    def copy_(self, other: "MambaLayerCache") -> None:
        self.conv_state.copy_(other.conv_state)
        self.ssm_state.copy_(other.ssm_state)


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

    @property
    def batch_size(self) -> int:
        return self.seqlen.shape[0]

    def select(self, rows: torch.Tensor) -> "ModelCache":
        """A new cache whose row r is a copy of row rows[r] (used to branch a drafter per tree node)."""
        return ModelCache([None if c is None else c.select(rows) for c in self.layers], self.seqlen[rows].clone())

    def copy_(self, other: "ModelCache") -> None:
        for mine, theirs in zip(self.layers, other.layers):
            if mine is not None:
                mine.copy_(theirs)
        self.seqlen.copy_(other.seqlen)

    def reset_(self) -> None:
        """Empty the cache in place (tensors keep their storage, so captured graphs stay valid)."""
        for layer in self.layers:
            if layer is None:
                continue
            for t in vars(layer).values():
                t.zero_()
        self.seqlen.zero_()

    def clone(self) -> "ModelCache":
        return self.select(torch.arange(self.batch_size, device=self.seqlen.device))
