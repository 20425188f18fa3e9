"""The verify path's fused kernels on a real GPU at mamba2-2.7b layer sizes, bf16 (opt in: --run-gpu)."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close
from ssmspec.trees import Tree

pytestmark = pytest.mark.requires_cuda
DEV = "cuda"
H, P, S, G, K = 80, 64, 128, 1, 4
D_INNER, CONV_DIM = H * P, H * P + 2 * G * S  # 5120, 5376
TREES = {"16: 3,4": Tree.from_config((3, 4)), "64: 3,4,2,1": Tree.from_config((3, 4, 2, 1)), "64: chain": Tree.chain(63)}


def _poison(nbytes):
    """Free a NaN block so that the kernel's next allocation likely reuses it (unwritten lanes -> NaN)."""
    del_me = torch.full((nbytes // 4 + 1024,), float("nan"), device=DEV)
    del del_me


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _layer_inputs(batch, n):
    """bf16 activations as the model holds them: z, xBC and dt_raw are column slices of one in_proj
    output, x, B and C column slices of one conv output; dt_bias as mamba2's init (dt in [1e-3, 0.1])."""
    proj = torch.randn(batch, n, D_INNER + CONV_DIM + H, device=DEV, dtype=torch.bfloat16)
    z, xBC, dt_raw = proj.split([D_INNER, CONV_DIM, H], dim=-1)
    conv = torch.randn(batch, n, CONV_DIM, device=DEV, dtype=torch.bfloat16)
    conv[..., D_INNER:] *= 0.3
    x, B, C = conv.split([D_INNER, G * S, G * S], dim=-1)
    dt0 = torch.exp(torch.rand(H, device=DEV) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return {
        "z": z, "xBC": xBC, "dt_raw": dt_raw,
        "x": x.unflatten(-1, (H, P)), "B": B.unflatten(-1, (G, S)), "C": C.unflatten(-1, (G, S)),
        "dt_bias": dt0 + torch.log(-torch.expm1(-dt0)),  # softplus^-1(dt0)
        "A": -(1 + torch.rand(H, device=DEV) * 15), "D": torch.randn(H, device=DEV),
        "h0": torch.randn(batch, H, P, S, device=DEV),
    }


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("clamp", [(0.0, math.inf), (1e-3, 0.05)], ids=["unclamped", "clamped"])
def test_tree_scan_gated_gpu(tree_name, batch, clamp):
    from ssmspec.ops.tree_scan.naive import naive_tree_scan_gated
    from ssmspec.ops.tree_scan.triton import tree_scan_gated

    tree = TREES[tree_name]
    v = _layer_inputs(batch, tree.num_nodes)
    args = (v["x"], v["dt_raw"], v["dt_bias"], *clamp, v["A"], v["B"], v["C"], v["D"], v["z"],
            tree.parents_tensor(DEV), v["h0"])
    want_g, want_dt = naive_tree_scan_gated(*args)
    for precision, tol in (("ieee", 5e-3), (None, 5e-3)):  # None: tf32 for bf16 inputs
        _poison(want_g.numel() * 2 + want_dt.numel() * 4)
        g, dt = tree_scan_gated(*args, precision=precision)
        assert g.dtype == torch.bfloat16 and g.shape == (batch, tree.num_nodes, D_INNER)
        assert_close(dt, want_dt, atol=1e-6, rtol=1e-5, name=f"dt {precision}")
        # g is bf16: only the rounding of y and of the product differ (about 2^-9 relative each)
        assert torch.isfinite(g).all() and _rel(g, want_g) < tol, f"{precision}: rel err {_rel(g, want_g):.2e}"
    g, dt, sq = tree_scan_gated(*args, return_sq=True)  # the partial sums of squares for out_proj's norm
    want_sq = g.float().unflatten(-1, (v["B"].shape[2], -1)).pow(2).sum(-1).flatten()
    assert _rel(sq.sum(-1).flatten(), want_sq) < 1e-5


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("batch", [1, 4])
def test_replay_states_gpu(tree_name, batch):
    from ssmspec.ops.state_replay.naive import naive_replay_states
    from ssmspec.ops.state_replay.triton import replay_states

    tree = TREES[tree_name]
    n = tree.num_nodes
    v = _layer_inputs(batch, n)
    deepest = max(range(n), key=lambda i: len(tree.path(i)))
    path = torch.tensor([tree.path(deepest)] * batch, device=DEV)  # (B, M), M = depth + 1
    m = path.shape[1]
    path_len = torch.tensor([m, 0, max(1, m // 2), 1][:batch], device=DEV)  # full, none, partial, root only
    dt = torch.rand(batch, n, H, device=DEV) * 0.1
    conv_state = torch.randn(batch, CONV_DIM, K - 1, device=DEV, dtype=torch.bfloat16)
    ssm_state = torch.randn(batch, H, P, S, device=DEV)
    c_want, s_want = conv_state.clone(), ssm_state.clone()
    naive_replay_states(c_want, s_want, v["xBC"], v["x"], dt, v["A"], v["B"], path, path_len)
    replay_states(conv_state, ssm_state, v["xBC"], v["x"], dt, v["A"], v["B"], path, path_len)
    assert torch.equal(conv_state, c_want)
    assert_close(ssm_state, s_want, atol=1e-5, rtol=1e-5, name="ssm_state")


@pytest.mark.parametrize("written_after", [False, True], ids=["copy-in-graph", "written-after-capture"])
@pytest.mark.parametrize("batch", [1, 4])
def test_replay_states_layers_in_cuda_graph_gpu(batch, written_after, monkeypatch):
    """All layers' replay in one launch, captured in a CUDA graph and replayed twice with other
    lengths written into the static path_len, advancing every layer as the reference does. The
    pointer table is either copied by the graph at each replay (its pinned host buffer must
    outlive the capture) or, inside `graph_tables.written_after_capture`, written once after the
    capture (the graph then never reads the host buffer: it is overwritten before the replays).
    Before the replay the graph writes a scratch tensor that it frees again, as a verify does with
    its temporaries: a table in the graph's own pool could take that block and be overwritten at
    every replay."""
    import contextlib
    import gc

    from ssmspec.ops import graph_tables
    from ssmspec.ops.state_replay import triton as SR
    from ssmspec.ops.state_replay.naive import naive_replay_states_layers

    monkeypatch.setattr(SR, "replay_states", lambda *a: pytest.fail("fell back to per-layer launches"))
    tree, n_layers = TREES["64: 3,4,2,1"], 3
    n = tree.num_nodes
    acts = [_layer_inputs(batch, n) for _ in range(n_layers)]  # each layer its own allocations
    dts = [torch.rand(batch, n, H, device=DEV) * 0.1 for _ in range(n_layers)]
    deepest = max(range(n), key=lambda i: len(tree.path(i)))
    path = torch.tensor([tree.path(deepest)] * batch, device=DEV)  # (B, M), M = depth + 1
    m = path.shape[1]
    path_len = torch.full((batch,), m, device=DEV)  # static: rewritten before each replay
    conv = [torch.randn(batch, CONV_DIM, K - 1, device=DEV, dtype=torch.bfloat16) for _ in range(n_layers)]
    ssm = [torch.randn(batch, H, P, S, device=DEV) for _ in range(n_layers)]

    def args(conv_states, ssm_states):
        return (conv_states, ssm_states, [a["xBC"] for a in acts], [a["x"] for a in acts], dts,
                [a["A"] for a in acts], [a["B"] for a in acts], path, path_len)

    side = torch.cuda.Stream()  # compile outside the capture, on copies of the states
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        SR.replay_states_layers(*args([c.clone() for c in conv], [h.clone() for h in ssm]))
    torch.cuda.current_stream().wait_stream(side)
    kept = len(graph_tables._kept)
    graph = torch.cuda.CUDAGraph()
    with (graph_tables.written_after_capture(owner=graph) if written_after else contextlib.nullcontext()), \
            torch.cuda.graph(graph):
        scratch = torch.full((64 * 1024,), -1, dtype=torch.int64, device=DEV)
        del scratch
        SR.replay_states_layers(*args(conv, ssm))
    held = graph_tables._kept_by_owner[graph] if written_after else graph_tables._kept[kept:]
    assert len(held) == 1  # kept as long as the graph (without an owner: the process)
    if written_after:
        ((table, host),) = held[0]["tables"]
        torch.cuda.synchronize()
        assert table.tolist() == host.tolist()
        host.fill_(-1)  # a graph that still read it would now follow wild pointers
    gc.collect()
    junk = [torch.full((n_layers, 7), -1, dtype=torch.int64, pin_memory=True) for _ in range(8)]  # noqa: F841
    c_want, s_want = [c.clone() for c in conv], [h.clone() for h in ssm]
    for lens in ([m, 1, 0, max(1, m // 2)], [1, m, 2, m]):
        path_len.copy_(torch.tensor(lens[:batch], device=DEV))
        graph.replay()
        naive_replay_states_layers(*args(c_want, s_want))
        torch.cuda.synchronize()
        for i in range(n_layers):
            assert torch.equal(conv[i], c_want[i]), f"layer {i} conv_state after lengths {lens[:batch]}"
            assert_close(ssm[i], s_want[i], atol=1e-5, rtol=1e-5, name=f"layer {i} ssm_state {lens[:batch]}")


def _pending_slots(batch, capacity, counts):
    """bf16 pending x and B, fp32 dt, as a cache holds them, and each row's count."""
    return (torch.randn(batch, capacity, H, P, device=DEV, dtype=torch.bfloat16),
            torch.rand(batch, capacity, H, device=DEV) * 0.1,
            torch.randn(batch, capacity, G, S, device=DEV, dtype=torch.bfloat16) * 0.3,
            torch.tensor(counts, device=DEV))


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("capacity", [16, 32])
def test_tree_scan_gated_with_pending_gpu(tree_name, capacity):
    """The scan that reads pending inputs (models/cache.py) against the reference, rows with
    none, some and all slots valid."""
    from ssmspec.ops.tree_scan.naive import naive_tree_scan_gated
    from ssmspec.ops.tree_scan.triton import tree_scan_gated

    tree = TREES[tree_name]
    v = _layer_inputs(3, tree.num_nodes)
    pending = _pending_slots(3, capacity, [0, capacity // 2 + 1, capacity])
    args = (v["x"], v["dt_raw"], v["dt_bias"], 0.0, math.inf, v["A"], v["B"], v["C"], v["D"], v["z"],
            tree.parents_tensor(DEV), v["h0"])
    want_g, _ = naive_tree_scan_gated(*args, pending=pending)
    plain_g, _ = naive_tree_scan_gated(*args)
    _poison(want_g.numel() * 2)
    g, _ = tree_scan_gated(*args, pending=pending)
    assert torch.isfinite(g).all() and _rel(g, want_g) < 5e-3, f"rel err {_rel(g, want_g):.2e}"
    assert _rel(g[0], plain_g[0]) < 5e-3 and _rel(want_g[1], plain_g[1]) > 1e-2  # the slots matter


def test_deferred_replay_layers_in_cuda_graph_gpu():
    """All layers' deferred replay and the count update, captured once and replayed over several
    iterations (appends and flushes decided on the device), then a settle: the states equal
    plain replays of the same paths."""
    from ssmspec.ops.state_replay import triton as SR
    from ssmspec.ops.state_replay.naive import naive_replay_states_layers

    tree, n_layers, batch, capacity = TREES["16: 3,4"], 3, 2, 8
    n = tree.num_nodes
    acts = [_layer_inputs(batch, n) for _ in range(n_layers)]
    dts = [torch.rand(batch, n, H, device=DEV) * 0.1 for _ in range(n_layers)]
    path = torch.tensor([tree.path(n - 1)] * batch, device=DEV)  # (B, 3)
    m = path.shape[1]
    path_len = torch.full((batch,), m, device=DEV)
    conv = [torch.randn(batch, CONV_DIM, K - 1, device=DEV, dtype=torch.bfloat16) for _ in range(n_layers)]
    ssm = [torch.randn(batch, H, P, S, device=DEV) for _ in range(n_layers)]
    slots = [_pending_slots(batch, capacity, [0] * batch) for _ in range(n_layers)]
    count, seqlen = slots[0][3], torch.zeros(batch, dtype=torch.long, device=DEV)
    pending = ([s[0] for s in slots], [s[1] for s in slots], [s[2] for s in slots], count)

    def iteration(conv_states, ssm_states, pend):
        SR.replay_states_layers(conv_states, ssm_states, [a["xBC"] for a in acts], [a["x"] for a in acts], dts,
                                [a["A"] for a in acts], [a["B"] for a in acts], path, path_len, pend)
        if pend is not None:
            SR.advance_positions(seqlen, pend[3], path_len, m, capacity)

    side = torch.cuda.Stream()  # compile outside the capture, on copies
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        scratch = ([t.clone() for t in pending[0]], [t.clone() for t in pending[1]], [t.clone() for t in pending[2]],
                   count.clone())
        iteration([c.clone() for c in conv], [h.clone() for h in ssm], scratch)
    torch.cuda.current_stream().wait_stream(side)
    seqlen.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        iteration(conv, ssm, pending)
    c_want, s_want = [c.clone() for c in conv], [h.clone() for h in ssm]
    counts = []
    for lens in ([m, 1], [2, m], [m, m], [1, 0], [m, 2]):
        path_len.copy_(torch.tensor(lens, device=DEV))
        graph.replay()
        naive_replay_states_layers(c_want, s_want, [a["xBC"] for a in acts], [a["x"] for a in acts], dts,
                                   [a["A"] for a in acts], [a["B"] for a in acts], path, path_len)
        torch.cuda.synchronize()
        counts.append(count.tolist())
        for i in range(n_layers):
            assert torch.equal(conv[i], c_want[i]), f"layer {i} conv_state after lengths {lens}"
    assert any(c == 0 for row in counts for c in row) and max(c for row in counts for c in row) > 0, counts
    SR.settle_pending_layers(ssm, [a["A"] for a in acts], pending)
    for i in range(n_layers):
        assert_close(ssm[i], s_want[i], atol=1e-4, rtol=1e-4, name=f"layer {i} ssm_state")
