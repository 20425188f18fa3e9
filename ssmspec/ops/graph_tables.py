"""Device tables of addresses that a captured launch reads (the replay's per-layer pointers).

Inside a CUDA graph the captured tensors keep their addresses at every replay, so such a table
never changes. Captured plainly, its upload is a host-to-device copy node on the iteration's chain
before the kernel that reads it (the copy reads its pinned host buffer at every replay, and ends
the programmatic dependent launch of the kernel after it). Inside `written_after_capture` the
table is instead a slice of an arena allocated before the capture and written once when the
capture ends. (Not memory of the graph's own pool: the capture may hand a table a block that an
earlier kernel of the same graph writes at every replay.)

`capture(graph)` is how ssmspec captures a graph: `torch.cuda.graph` inside `written_after_capture`,
with Python's garbage collector held off.
"""
from __future__ import annotations

import contextlib
import gc
import weakref

import torch

ARENA_ENTRIES = 8192
"""int64 entries of one capture's arena (64 KB; mamba2-2.7b's replay table takes 640)."""

_arena: dict | None = None
"""The innermost `written_after_capture`'s arena: its tensor, entries used, (slice, host rows) to
write, and the list that keeps what the graph reads."""
_kept_by_owner: "weakref.WeakKeyDictionary[object, list]" = weakref.WeakKeyDictionary()
"""Arenas and host buffers that a captured graph reads, alive as long as the graph (its owner)."""
_kept: list = []
"""The same for captures without an owner (a table captured outside `written_after_capture`):
alive as long as the process."""


@contextlib.contextmanager
def written_after_capture(device: torch.device | None = None, owner: object | None = None):
    """Around a `torch.cuda.graph(...)` block (entered before it): the tables that `device_table`
    makes inside the capture are slices of an arena allocated here, written on the current stream
    when the block exits without an error (before any replay on that stream). A table that does
    not fit the arena is captured as a copy, as outside this context. owner: the captured graph,
    which keeps the arena and host buffers alive (without one they live as long as the process)."""
    global _arena
    outer = _arena
    device = device or torch.device("cuda", torch.cuda.current_device())
    kept = _kept if owner is None else _kept_by_owner.setdefault(owner, [])
    _arena = {"arena": torch.empty(ARENA_ENTRIES, dtype=torch.int64, device=device), "used": 0, "tables": [],
              "kept": kept}
    try:
        yield
        arena = _arena
        for table, host in arena["tables"]:
            table.copy_(host, non_blocking=True)
        if arena["tables"]:
            kept.append(arena)  # the graph reads the arena; the copies read the host buffers
    finally:
        _arena = outer


@contextlib.contextmanager
def capture(graph: "torch.cuda.CUDAGraph"):
    """`with torch.cuda.graph(graph)` inside `written_after_capture(owner=graph)`, with Python's
    garbage collector held off until the capture ends. A graph that the collector frees during a
    capture (one of a replaced cache, say, kept in a reference cycle) resets its executable, which
    CUDA forbids while a stream captures: the capture would fail ("operation failed due to a
    previous error during capture"). torch itself collects as a capture starts."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        with written_after_capture(owner=graph), torch.cuda.graph(graph):
            yield
    finally:
        if collecting:
            gc.enable()


def device_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """(len(rows), len(rows[0])) int64 on `device`, made without a host sync; safe to capture."""
    if device.type != "cuda":  # the interpreter reads host memory
        return torch.tensor(rows, dtype=torch.int64)
    host = torch.tensor(rows, dtype=torch.int64, pin_memory=True)
    if torch.cuda.is_current_stream_capturing():
        arena = _arena
        entries = host.numel()
        if arena is not None and arena["arena"].device == device and arena["used"] + entries <= ARENA_ENTRIES:
            start = arena["used"]
            arena["used"] += -(-entries // 2) * 2  # the next table 16-byte aligned
            table = arena["arena"][start:start + entries].view(host.shape)
            arena["tables"].append((table, host))
            return table
        (_kept if arena is None else arena["kept"]).append(host)  # the captured copy reads it at every replay
    # Outside capture the caching host allocator keeps `host` until the copy has run.
    return host.to(device, non_blocking=True)
