"""ops/graph_tables off the GPU: tables on the CPU are plain tensors, and the capture context
nests and leaves nothing behind (the capture itself: tests/gpu/test_verify_fused_gpu.py)."""
from __future__ import annotations

import pytest
import torch

from ssmspec.ops import graph_tables


def test_a_cpu_table_holds_the_rows():
    table = graph_tables.device_table([[1, 2, 3], [4, 5, 6]], torch.device("cpu"))
    assert table.dtype == torch.int64 and table.tolist() == [[1, 2, 3], [4, 5, 6]]


def test_the_context_nests_and_restores_on_errors():
    """(Its arena on the CPU here: the context itself is device-agnostic; tables are made only
    while a CUDA stream captures.)"""
    cpu = torch.device("cpu")
    assert graph_tables._arena is None
    with graph_tables.written_after_capture(cpu):
        outer = graph_tables._arena
        with graph_tables.written_after_capture(cpu):
            assert graph_tables._arena is not outer and graph_tables._arena["tables"] == []
        assert graph_tables._arena is outer
    assert graph_tables._arena is None
    with pytest.raises(RuntimeError), graph_tables.written_after_capture(cpu):
        raise RuntimeError("capture failed")
    assert graph_tables._arena is None


def test_what_a_graph_reads_lives_as_long_as_the_graph():
    """With an owner (the captured graph) the arena and host buffers are kept for it, and let go
    with it: nothing accumulates over the process as graphs come and go."""
    import gc

    class Graph:  # stands in for torch.cuda.CUDAGraph (weakly referenceable, as it is)
        pass

    cpu = torch.device("cpu")
    before = len(graph_tables._kept_by_owner)
    graphs = [Graph() for _ in range(3)]
    for g in graphs:
        with graph_tables.written_after_capture(cpu, owner=g):
            assert graph_tables._arena["kept"] is graph_tables._kept_by_owner[g]
    assert len(graph_tables._kept_by_owner) == before + 3
    kept = len(graph_tables._kept)
    del graphs, g
    gc.collect()
    assert len(graph_tables._kept_by_owner) == before and len(graph_tables._kept) == kept


def test_capture_holds_the_collector_off_and_restores_it(monkeypatch):
    """A graph freed by the collector mid-capture invalidates the capture (the cold-start bug of
    2026-11-27): `capture` keeps the collector off inside torch.cuda.graph, and gives it back as
    it found it, on errors too. (torch.cuda.graph stands in for a recorder here: no GPU.)"""
    import contextlib
    import gc

    seen = []

    @contextlib.contextmanager
    def recorder(graph):
        seen.append((graph, gc.isenabled(), graph_tables._arena is not None))
        yield

    class Graph:  # stands in for torch.cuda.CUDAGraph (weakly referenceable, as it is)
        pass

    monkeypatch.setattr(torch.cuda, "graph", recorder)
    real = graph_tables.written_after_capture
    monkeypatch.setattr(graph_tables, "written_after_capture",
                        lambda owner: real(torch.device("cpu"), owner=owner))
    owner = Graph()
    assert gc.isenabled()
    with graph_tables.capture(owner):
        pass
    assert seen == [(owner, False, True)] and gc.isenabled()
    with pytest.raises(RuntimeError), graph_tables.capture(owner):
        raise RuntimeError("capture failed")
    assert gc.isenabled() and graph_tables._arena is None
    gc.disable()
    try:
        with graph_tables.capture(owner):
            pass
        assert not gc.isenabled()  # left off: the caller had it off
    finally:
        gc.enable()
