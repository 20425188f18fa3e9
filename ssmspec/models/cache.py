"""Explicit inference caches: conv + SSM state per Mamba layer, keys/values per attention layer.

Every tensor keeps a leading batch dimension, and the sequence length is a per-row device tensor,
so rows that accept different numbers of tokens can share one cache.

A cache may also hold pending inputs (ReplaySSM, papers/replayssm-cache-inputs-not-state): the
SSM inputs (x, dt, B) of up to `pending_capacity` committed tokens that the SSM state has not
absorbed yet. A tree iteration then reads the state and those inputs instead of writing the state
back after every iteration; the state is written only when the slots would overflow (a flush).
The pending count of each row is a device tensor (no host sync); paths that absorb tokens into the
state directly (step, forward) need it at 0, which `LanguageModel.settle` ensures.

A cache may be row-packed (`packed_mamba_rows`, `LanguageModel.new_cache(packed=True)`): every row's
Mamba states of all layers and its seqlen live in one contiguous span of one buffer, and each
tensor is a strided view into it (batch stride = the whole row). Copying or gathering whole rows
(a drafter branching its state per tree node) is then one launch instead of two per layer and one
for seqlen. The kernels that read the states take their strides, so they run on either layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

ROW_ALIGN = 16
"""Bytes every tensor's span inside a packed row (and so the row itself) is aligned to, as the
kernels' vectorised loads of fp32 states expect of their base pointers."""


def packed_mamba_rows(batch: int, layers: list, device) -> tuple[torch.Tensor, list, torch.Tensor]:
    """One buffer holding, per row, the states of every Mamba layer and the row's seqlen.

    Args:
        layers: the layers' empty caches as templates (only their shapes and dtypes are read; a
            None or non-Mamba entry is left out of the row).
    Returns:
        the (B, W) int64 row buffer, zeroed; per layer a MambaLayerCache of views into it (None
        for the entries left out); seqlen (B,) int64, a view into it.
    """
    specs = []  # (layer, field, shape without the batch, dtype): widest elements first, so no padding is wasted
    for i, c in enumerate(layers):
        if isinstance(c, MambaLayerCache):
            if c.pending_x is not None:
                raise ValueError("a packed cache keeps no pending inputs (new_cache(pending=...) needs packed=False)")
            specs += [(i, "ssm_state", tuple(c.ssm_state.shape[1:]), c.ssm_state.dtype),
                      (i, "conv_state", tuple(c.conv_state.shape[1:]), c.conv_state.dtype)]
    specs.sort(key=lambda s: -s[3].itemsize)
    offsets, row_bytes = [], 0
    for _, _, shape, dtype in specs:
        offsets.append(row_bytes)
        row_bytes += -(-math.prod(shape) * dtype.itemsize // ROW_ALIGN) * ROW_ALIGN
    seqlen_at = row_bytes
    row_bytes += ROW_ALIGN  # seqlen's 8 bytes, the row padded to the alignment
    rows = torch.zeros(batch, row_bytes // 8, dtype=torch.int64, device=device)
    as_bytes = rows.view(torch.uint8)  # (B, row_bytes)
    views: dict[int, dict] = {}
    for (i, name, shape, dtype), at in zip(specs, offsets):
        span = as_bytes[:, at:at + math.prod(shape) * dtype.itemsize].view(dtype)  # (B, numel), row stride W
        views.setdefault(i, {})[name] = span.view(batch, *shape)
    caches = [MambaLayerCache(**views[i]) if i in views else None for i in range(len(layers))]
    seqlen = as_bytes[:, seqlen_at:seqlen_at + 8].view(torch.int64)[:, 0]  # (B,)
    return rows, caches, seqlen


@dataclass
class MambaLayerCache:
    conv_state: torch.Tensor
    """(B, C, K-1) the last K-1 pre-conv inputs, oldest first (always up to date)."""
    ssm_state: torch.Tensor
    """(B, H, P, S) fp32: the state before the pending inputs (all of the state when none)."""
    pending_x: torch.Tensor | None = None
    """(B, L, H, P) SSM inputs after the conv of the pending tokens, oldest first; or None."""
    pending_dt: torch.Tensor | None = None
    """(B, L, H) fp32 their time steps."""
    pending_B: torch.Tensor | None = None
    """(B, L, G, S) their B."""

    def _tensors(self):
        return [(f.name, getattr(self, f.name)) for f in fields(self) if getattr(self, f.name) is not None]

    def select(self, rows: torch.Tensor) -> "MambaLayerCache":
        return MambaLayerCache(**{name: t[rows] for name, t in self._tensors()})

    def rows(self, start: int, length: int) -> "MambaLayerCache":
        """A view of rows start .. start + length - 1 (writes go to this cache)."""
        return MambaLayerCache(**{name: t.narrow(0, start, length) for name, t in self._tensors()})

    def copy_(self, other: "MambaLayerCache") -> None:
        for name, t in self._tensors():
            t.copy_(getattr(other, name))

    def gather_(self, other: "MambaLayerCache", rows: torch.Tensor) -> None:
        """Row r := other's row rows[r], one launch per tensor (no intermediate copy)."""
        for name, t in self._tensors():
            torch.index_select(getattr(other, name), 0, rows, out=t)


@dataclass
class AttentionLayerCache:
    keys: torch.Tensor
    """(B, Hkv, T_max, D) after RoPE; entries at or past the row's length are garbage."""
    values: torch.Tensor
    """(B, Hkv, T_max, D)."""

    def select(self, rows: torch.Tensor) -> "AttentionLayerCache":
        return AttentionLayerCache(self.keys[rows], self.values[rows])

    def rows(self, start: int, length: int) -> "AttentionLayerCache":
        """A view of rows start .. start + length - 1 (writes go to this cache)."""
        return AttentionLayerCache(self.keys.narrow(0, start, length), self.values.narrow(0, start, length))

    def copy_(self, other: "AttentionLayerCache") -> None:
        self.keys.copy_(other.keys)
        self.values.copy_(other.values)

    def gather_(self, other: "AttentionLayerCache", rows: torch.Tensor) -> None:
        """Row r := other's row rows[r]."""
        torch.index_select(other.keys, 0, rows, out=self.keys)
        torch.index_select(other.values, 0, rows, out=self.values)


@dataclass
class ModelCache:
    layers: list
    """One MambaLayerCache, AttentionLayerCache or None (MLP) per sublayer."""
    seqlen: torch.Tensor
    """(B,) int64 tokens already in the cache for each row."""
    pending_count: torch.Tensor | None = None
    """(B,) int64 pending inputs of each row (the first slots); None: the cache keeps none."""
    pending_dirty: bool = False
    """Host-side: pending inputs may be non-empty (set by `replay`, cleared by `settle`), so paths
    that read the SSM state directly (step, forward) flush first."""
    packed_rows: torch.Tensor | None = None
    """(B, W) int64 of a row-packed cache (`packed_mamba_rows`): row r's Mamba states and seqlen,
    which are views into it; None for the plain layout."""

    def _packed_like(self, other: "ModelCache") -> bool:
        """Whether whole rows of `other` can be copied into this cache's as one span."""
        return (self.packed_rows is not None and other.packed_rows is not None
                and self.packed_rows.shape[1] == other.packed_rows.shape[1])

    @property
    def batch_size(self) -> int:
        return self.seqlen.shape[0]

    @property
    def pending_capacity(self) -> int:
        """Pending input slots per row (0 when the cache keeps none)."""
        if self.pending_count is None:
            return 0
        first = next(c for c in self.layers if isinstance(c, MambaLayerCache))
        return first.pending_x.shape[1]

    def pending_inputs(self, layer: int):
        """(x, dt, B, count) of Mamba layer `layer` for the ops, or None."""
        c = self.layers[layer]
        if self.pending_count is None or not isinstance(c, MambaLayerCache):
            return None
        return c.pending_x, c.pending_dt, c.pending_B, self.pending_count

    def select(self, rows: torch.Tensor) -> "ModelCache":
        """A new cache whose row r is a copy of row rows[r] (used to branch a drafter per tree node)."""
        count = None if self.pending_count is None else self.pending_count[rows].clone()
        return ModelCache([None if c is None else c.select(rows) for c in self.layers], self.seqlen[rows].clone(),
                          count, self.pending_dirty)

    def rows(self, start: int, length: int) -> "ModelCache":
        """A view of rows start .. start + length - 1: steps on it advance those rows of this cache."""
        count = None if self.pending_count is None else self.pending_count.narrow(0, start, length)
        packed = None if self.packed_rows is None else self.packed_rows.narrow(0, start, length)
        return ModelCache([None if c is None else c.rows(start, length) for c in self.layers],
                          self.seqlen.narrow(0, start, length), count, self.pending_dirty, packed)

    def copy_(self, other: "ModelCache") -> None:
        """Every row := other's (same batch). Between packed caches of one layout: one launch for
        the Mamba states and seqlen, one per tensor of the other layers."""
        packed = self._packed_like(other)
        if packed:
            self.packed_rows.copy_(other.packed_rows)
        for mine, theirs in zip(self.layers, other.layers):
            if mine is not None and not (packed and isinstance(mine, MambaLayerCache)):
                mine.copy_(theirs)
        if not packed:
            self.seqlen.copy_(other.seqlen)
        if self.pending_count is not None:
            self.pending_count.copy_(other.pending_count)
            self.pending_dirty = other.pending_dirty

    def gather_(self, other: "ModelCache", rows: torch.Tensor) -> None:
        """Row r := other's row rows[r] (rows a device tensor: no host sync, capturable). Both
        caches must have the same layers; a view from `rows()` may be the destination. Between
        packed caches of one layout the Mamba states and seqlen are one launch."""
        packed = self._packed_like(other)
        if packed:
            torch.index_select(other.packed_rows, 0, rows, out=self.packed_rows)
        for mine, theirs in zip(self.layers, other.layers):
            if mine is not None and not (packed and isinstance(mine, MambaLayerCache)):
                mine.gather_(theirs, rows)
        if not packed:
            torch.index_select(other.seqlen, 0, rows, out=self.seqlen)
        if self.pending_count is not None:
            torch.index_select(other.pending_count, 0, rows, out=self.pending_count)

    def reset_(self) -> None:
        """Empty the cache in place (tensors keep their storage, so captured graphs stay valid)."""
        packed = self.packed_rows is not None  # the Mamba states and seqlen are views of it: one zero
        tensors = [t for layer in self.layers if layer is not None and not (packed and isinstance(layer, MambaLayerCache))
                   for t in vars(layer).values() if t is not None]
        tensors.append(self.packed_rows if packed else self.seqlen)
        if self.pending_count is not None:
            tensors.append(self.pending_count)
        # One multi-tensor launch per dtype instead of one per tensor: a list of mixed dtypes takes
        # torch's per-tensor route (48 to 120 launches for a 24-layer target, 0.44 to 0.70 ms of
        # host time per generation on the H100), so each dtype goes in its own list.
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            torch._foreach_zero_(group)
        self.pending_dirty = False

    def without_pending(self) -> "ModelCache":
        """A view of this cache whose replays write the SSM states directly, as if it kept no
        pending slots. Its pending count must be 0 (after a reset, or `LanguageModel.settle`):
        the view neither reads nor advances it."""
        return ModelCache(self.layers, self.seqlen, packed_rows=self.packed_rows)

    def clone(self) -> "ModelCache":
        return self.select(torch.arange(self.batch_size, device=self.seqlen.device))
