"""Constant inputs that a CUDA-graph capture writes once, after the capture has ended.

Some launches read a small table that is fixed for the life of the graph (the per-layer base
addresses of `state_replay.replay_states_layers`). Built inside a capture with a host-to-device
copy, the table becomes a copy node that every replay runs again, and a memcpy node in an
otherwise all-kernel graph also costs launch time. Within `tables_written_after_capture()` such a
table is instead a slice of a device arena reserved before the capture began, filled once when
the block exits, after `torch.cuda.graph` has closed the capture:

    with capture.tables_written_after_capture(), torch.cuda.graph(graph):
        fn()

(`with A, B` exits B first, so the capture has ended when A writes.) Outside such a block the
launches keep their capture-safe copy, so a capture that does not use it still works.
"""
from __future__ import annotations

import contextlib

import torch

DEFER = True
"""Benchmarks set this False to time the graphs with the per-replay copy instead."""

ARENA_ELEMENTS = 4096
"""int64 slots reserved per deferring capture (a table of L layers x 7 addresses takes 7 L)."""

_pending: list[tuple[torch.Tensor, torch.Tensor]] | None = None
_arena: torch.Tensor | None = None
_used = 0
_kept: list[torch.Tensor] = []
"""Arenas of finished captures: a graph's launches read their tables at every replay, so they
live as long as the process (32 KB each)."""


def deferring() -> bool:
    """Whether a capture is under way inside `tables_written_after_capture()`."""
    return DEFER and _pending is not None and _capturing()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def device_table(host: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A device tensor shaped like the int64 tensor `host`, written with it when the enclosing
    `tables_written_after_capture()` block exits; None when the block's arena has no room or is
    on another device (the caller then keeps its captured copy). Only valid while `deferring()`.

    The tables come from an arena allocated before the capture began: memory allocated during a
    capture comes from the graph's private pool, where a block that another tensor freed earlier
    in the capture is handed out again, so the graph's own earlier kernels would overwrite a
    table allocated there at every replay (measured: an illegal address on the H100)."""
    global _used
    if not deferring():
        raise RuntimeError("capture.device_table needs a capture inside tables_written_after_capture()")
    n = host.numel()
    if (_arena is None or host.dtype != _arena.dtype or _arena.device != torch.device(device)
            or _used + n > _arena.numel()):
        return None
    table = _arena[_used:_used + n].view(host.shape)
    _used += -(-n // 2) * 2  # keep every table 16-byte aligned
    _pending.append((table, host.clone()))
    return table


@contextlib.contextmanager
def tables_written_after_capture():
    """Defer the tables built by captured launches in this block; write them when it exits."""
    global _pending, _arena, _used
    outer = _pending, _arena, _used
    _pending, _used = [], 0
    _arena = torch.empty(ARENA_ELEMENTS, dtype=torch.int64, device="cuda") if torch.cuda.is_available() else None
    try:
        yield
        if _capturing():
            raise RuntimeError("tables_written_after_capture() must enclose the torch.cuda.graph block, not sit inside it")
        for table, host in _pending:
            table.copy_(host)
        if _pending:
            _kept.append(_arena)
            torch.cuda.synchronize()
    finally:
        _pending, _arena, _used = outer
