"""Pending SSM inputs (ReplaySSM, models/cache.py): the tree scan that reads them, the replay
that appends to them or flushes them, the settle and the position update, against their
references, and the references against independent oracles.

Same arrangement as tests/test_ops_triton.py: the default run checks the references and the
model paths on the reference backend and spawns this file in a child process with
TRITON_INTERPRET=1, where the kernel tests below are defined and run (fp32; bf16 at model sizes
is in tests/gpu).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

from helpers import assert_close, tiny_model  # noqa: E402
from ssmspec.ops.state_replay.naive import (  # noqa: E402
    naive_advance_positions,
    naive_replay_ssm_state,
    naive_replay_states_layers,
    naive_settle_pending_layers,
)
from ssmspec.ops.tree_scan.naive import naive_tree_scan, naive_tree_scan_gated  # noqa: E402
from ssmspec.trees import Tree  # noqa: E402

# (batch, heads, head_dim, d_state, groups)
SHAPES = [(3, 4, 8, 16, 2), (3, 3, 16, 24, 1)]


def _pending(batch, capacity, heads, head_dim, d_state, groups, counts):
    """Pending slots filled with random inputs (garbage past each row's count, which must be
    ignored) and the count of valid slots of each row."""
    x = torch.randn(batch, capacity, heads, head_dim)
    dt = torch.rand(batch, capacity, heads) * 0.5 + 0.01
    B = torch.randn(batch, capacity, groups, d_state)
    return x, dt, B, torch.tensor(counts)


def _scan_inputs(batch, n, heads, head_dim, d_state, groups):
    return (torch.randn(batch, n, heads, head_dim), torch.rand(batch, n, heads) * 0.5 + 0.01,
            -(0.5 + torch.rand(heads) * 2), torch.randn(batch, n, groups, d_state),
            torch.randn(batch, n, groups, d_state), torch.randn(heads), torch.randn(batch, heads, head_dim, d_state))


def _layer_inputs(batch, n_layers, capacity, counts, shape=(4, 8, 16, 2), n=9, kernel_size=4):
    """Per-layer replay arguments with pending slots; returns (layers, pending, path)."""
    heads, head_dim, d_state, groups = shape
    layers = []
    for _ in range(n_layers):
        x, dt, A, B, _, _, h0 = _scan_inputs(batch, n, heads, head_dim, d_state, groups)
        channels = heads * head_dim + 2 * groups * d_state
        layers.append({"conv_state": torch.randn(batch, channels, kernel_size - 1), "ssm_state": h0,
                       "xBC": torch.randn(batch, n, channels), "x": x, "dt": dt, "A": A, "B": B})
    slots = [_pending(batch, capacity, heads, head_dim, d_state, groups, counts) for _ in range(n_layers)]
    pending = ([s[0] for s in slots], [s[1] for s in slots], [s[2] for s in slots], slots[0][3])
    return layers, pending, torch.randint(0, n, (batch, 4))


def _clone_all(layers, pending):
    layers = [{k: t.clone() for k, t in layer.items()} for layer in layers]
    pending = tuple([t.clone() for t in p] if isinstance(p, list) else p.clone() for p in pending)
    return layers, pending


def _layers_args(layers):
    keys = ("conv_state", "ssm_state", "xBC", "x", "dt", "A", "B")
    return [[layer[k] for layer in layers] for k in keys]


if not INTERPRETED:

    def test_pending_kernels_in_interpreter():
        from helpers import run_interpreted

        run_interpreted(__file__)

    @pytest.mark.parametrize("counts", [[0, 3, 5], [5, 5, 1]], ids=["none-some-all", "uneven"])
    def test_naive_scan_with_pending_is_the_tree_behind_a_chain(counts):
        """Oracle: the pending slots as a chain of nodes in front of the root, in one plain scan
        of the longer tree; the tree nodes' outputs must agree (each row its own chain)."""
        tree = Tree.from_config((2, 2, 1))
        batch, heads, head_dim, d_state, groups = SHAPES[0]
        capacity = 5
        x, dt, A, B, C, D, h0 = _scan_inputs(batch, tree.num_nodes, heads, head_dim, d_state, groups)
        px, pdt, pB, count = _pending(batch, capacity, heads, head_dim, d_state, groups, counts)
        got = naive_tree_scan(x, dt, A, B, C, D, tree.parents_tensor(), h0, (px, pdt, pB, count))
        for b, count in enumerate(counts):
            parents = list(range(-1, count - 1)) + [p + count if p >= 0 else count - 1 for p in tree.parents]
            rows = slice(b, b + 1)
            cat = lambda pend, tree_part: torch.cat([pend[rows, :count], tree_part[rows]], dim=1)  # noqa: E731
            C_chain = torch.cat([torch.zeros(1, count, groups, d_state), C[rows]], dim=1)
            want = naive_tree_scan(cat(px, x), cat(pdt, dt), A, cat(pB, B), C_chain, D, torch.tensor(parents), h0[rows])
            assert_close(got[rows], want[:, count:], atol=1e-4, rtol=1e-4, name=f"row {b}")

    def test_naive_deferred_replay_then_settle_equals_plain_replay():
        """Appends, flushes (rows at different counts) and a final settle leave the states that
        plain replays leave; the positions follow the flush rule."""
        batch, capacity = 3, 6
        layers, pending, path = _layer_inputs(batch, 2, capacity, [0, 0, 0])
        plain, _ = _clone_all(layers, pending)
        count = pending[3]
        seqlen = torch.zeros(batch, dtype=torch.long)
        for step, lens in enumerate([[1, 4, 2], [3, 4, 0], [4, 1, 2], [2, 4, 4]]):
            path_len = torch.tensor(lens)
            width = path.shape[1]
            before = count.clone()
            naive_replay_states_layers(*_layers_args(layers), path, path_len, pending)
            naive_advance_positions(seqlen, count, path_len, width, capacity)
            for b, n in enumerate(lens):
                flushed = int(before[b]) + n + width > capacity
                assert int(count[b]) == (0 if flushed else int(before[b]) + n), f"step {step} row {b}"
            naive_replay_states_layers(*_layers_args(plain), path, path_len)
            for got, want in zip(layers, plain):
                assert torch.equal(got["conv_state"], want["conv_state"])  # the conv state never waits
        assert torch.equal(seqlen, torch.tensor([10, 13, 8]))
        assert count.max() > 0, "the sequence should end with pending inputs to settle"
        naive_settle_pending_layers([layer["ssm_state"] for layer in layers], [layer["A"] for layer in layers], pending)
        for got, want in zip(layers, plain):
            assert_close(got["ssm_state"], want["ssm_state"], atol=1e-5, rtol=1e-5)

    def test_naive_gated_scan_passes_pending_through():
        tree = Tree.from_config((2, 1))
        batch, heads, head_dim, d_state, groups = SHAPES[1]
        x, dt, A, B, C, D, h0 = _scan_inputs(batch, tree.num_nodes, heads, head_dim, d_state, groups)
        pend = _pending(batch, 4, heads, head_dim, d_state, groups, [4, 0, 2])
        z, bias = torch.randn(batch, tree.num_nodes, heads * head_dim), torch.randn(heads)
        got, _ = naive_tree_scan_gated(x, dt, bias, 0.01, 5.0, A, B, C, D, z, tree.parents_tensor(), h0, pending=pend)
        px, pdt, pB, count = pend
        slots = torch.arange(4).expand(batch, 4)
        h1 = h0.clone()
        naive_replay_ssm_state(h1, px, pdt, A, pB, slots, count)
        want, _ = naive_tree_scan_gated(x, dt, bias, 0.01, 5.0, A, B, C, D, z, tree.parents_tensor(), h1)
        assert_close(got, want, atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("layers", [("mamba", "mamba"), ("mamba", "attention", "mlp", "mamba")],
                             ids=["mamba", "hybrid"])
    def test_model_with_pending_slots_matches_plain_cache(layers):
        _model_with_pending_matches_plain(layers, "reference")

    def test_cache_with_pending_slots_is_copied_and_reset():
        model = tiny_model()
        cache = model.new_cache(2, 16, pending=4)
        assert cache.pending_capacity == 4 and model.new_cache(1, 16).pending_capacity == 0
        cache.layers[0].pending_x.normal_()
        cache.pending_count += 3
        cache.pending_dirty = True
        copy = cache.clone()
        assert torch.equal(copy.layers[0].pending_x, cache.layers[0].pending_x) and copy.pending_dirty
        assert copy.layers[0].pending_x.data_ptr() != cache.layers[0].pending_x.data_ptr()
        cache.reset_()
        assert not cache.pending_dirty and cache.layers[0].pending_x.abs().sum() == 0 and cache.pending_count.sum() == 0
        cache.copy_(copy)
        assert int(cache.pending_count[0]) == 3 and cache.pending_dirty
        with pytest.raises(ValueError, match="pending slots"):
            model.new_cache(1, 16, pending=-1)

    def test_reset_zeroes_every_tensor_with_one_dtype_per_launch(monkeypatch):
        # torch's multi-tensor zero takes its one-launch route only for a list of one dtype; a
        # mixed list (bf16 conv, fp32 SSM, int64 counts) goes tensor by tensor on the GPU.
        model = tiny_model(("mamba", "attention", "mamba"))
        cache = model.new_cache(1, 16, pending=4)
        tensors = [t for layer in cache.layers if layer is not None for t in vars(layer).values() if t is not None]
        tensors += [cache.seqlen, cache.pending_count]
        for t in tensors:
            t.fill_(1)
        calls = []
        real = torch._foreach_zero_
        monkeypatch.setattr(torch, "_foreach_zero_", lambda group: (calls.append({t.dtype for t in group}), real(group)))
        cache.reset_()
        assert all(len(dtypes) == 1 for dtypes in calls) and len(calls) == len({t.dtype for t in tensors}) > 1
        assert all(t.abs().sum() == 0 for t in tensors)


def _model_with_pending_matches_plain(layers, backend):
    """Tree iterations on a cache with 6 pending slots (appends and flushes) against a plain
    cache: same logits at every verify, same states and logits after a step (which settles)."""
    from ssmspec.ops import dispatch

    with dispatch.use_backend(backend):
        torch.manual_seed(0)
        model = tiny_model(layers)
        tree = Tree.from_config((2, 2, 1))
        width = tree.max_depth + 1
        prompt = torch.randint(0, 64, (1, 7))
        plain, deferred = model.new_cache(1, 200), model.new_cache(1, 200, pending=6)
        counts = set()
        with torch.inference_mode():
            model(prompt, plain)
            model(prompt, deferred)
            for it in range(9):
                tokens = torch.randint(0, 64, (1, tree.num_nodes))
                want, acts_plain = model.verify(tokens, tree, plain)
                got, acts = model.verify(tokens, tree, deferred)
                assert_close(got, want, atol=1e-4, rtol=1e-4, name=f"verify {it}")
                n = 1 + it % width
                leaf = max(i for i in range(tree.num_nodes) if tree.depths[i] == n - 1)
                path = torch.zeros(1, width, dtype=torch.long)
                path[0, :n] = torch.tensor(tree.path(leaf))
                model.replay(plain, acts_plain, path, torch.tensor([n]))
                model.replay(deferred, acts, path, torch.tensor([n]))
                counts.add(int(deferred.pending_count))
                assert torch.equal(deferred.seqlen, plain.seqlen)
            assert 0 in counts and max(counts) > 0, f"no flush or no append: counts {counts}"
            ids = torch.randint(0, 64, (1, 1))
            assert_close(model.step(ids, deferred), model.step(ids, plain), atol=1e-4, rtol=1e-4, name="step")
            assert not deferred.pending_dirty and int(deferred.pending_count) == 0
            for a, b in zip(plain.layers, deferred.layers):
                if hasattr(a, "ssm_state"):
                    assert_close(b.ssm_state, a.ssm_state, atol=1e-4, rtol=1e-4, name="state")


if INTERPRETED:
    from ssmspec.ops.state_replay import triton as SR
    from ssmspec.ops.tree_scan import triton as TS

    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
    @pytest.mark.parametrize("block_s", [None, 8], ids=["one-chunk", "chunks"])
    @pytest.mark.parametrize("capacity", [5, 20])
    def test_tree_scan_with_pending_matches_reference(shape, block_s, capacity, nan_outputs, monkeypatch):
        monkeypatch.setattr(TS, "SCAN_BLOCK_S", block_s)
        tree = Tree.from_config((3, 2, 1))
        batch, heads, head_dim, d_state, groups = shape
        x, dt, A, B, C, D, h0 = _scan_inputs(batch, tree.num_nodes, heads, head_dim, d_state, groups)
        pend = _pending(batch, capacity, heads, head_dim, d_state, groups, [0, capacity, capacity // 2])
        parents = tree.parents_tensor()
        want = naive_tree_scan(x, dt, A, B, C, D, parents, h0, pend)
        assert_close(TS.tree_scan(x, dt, A, B, C, D, parents, h0, pending=pend), want, atol=1e-4, rtol=1e-4)
        z, bias = torch.randn(batch, tree.num_nodes, heads * head_dim), torch.randn(heads)
        got_g, got_dt = TS.tree_scan_gated(x, dt, bias, 0.01, 5.0, A, B, C, D, z, parents, h0, pending=pend)
        want_g, want_dt = naive_tree_scan_gated(x, dt, bias, 0.01, 5.0, A, B, C, D, z, parents, h0, pending=pend)
        assert_close(got_g, want_g, atol=1e-4, rtol=1e-4, name="gated")
        assert_close(got_dt, want_dt, atol=1e-6, rtol=1e-6, name="dt")

    def test_tree_scan_rejects_mismatched_pending():
        tree = Tree.from_config((2,))
        x, dt, A, B, C, D, h0 = _scan_inputs(2, tree.num_nodes, 4, 8, 16, 2)
        px, pdt, pB, count = _pending(2, 4, 4, 8, 16, 2, [1, 2])
        with pytest.raises(ValueError, match="pending B"):
            TS.tree_scan(x, dt, A, B, C, D, tree.parents_tensor(), h0, pending=(px, pdt, pB[..., :8], count))

    @pytest.mark.parametrize("one_launch, shape", [
        pytest.param(True, (4, 8, 16, 2), id="one-block-layers-table"),
        pytest.param(False, (4, 8, 16, 2), id="one-block-per-layer-fallback"),
        pytest.param(True, (36, 8, 16, 1), id="x-over-two-blocks-layers-table"),
        pytest.param(False, (36, 8, 16, 1), id="x-over-two-blocks-per-layer-fallback", marks=pytest.mark.slow),
    ])
    def test_deferred_replay_settle_and_advance_match_reference(one_launch, shape):
        """Rows that append and rows that flush, in one launch; the conv-block programs append
        (x's channels spread over blocks of 256, B's after them, dt in block 0)."""
        batch, capacity = 3, 7
        layers, pending, path = _layer_inputs(batch, 2, capacity, [0, 2, 4], shape=shape)
        if not one_launch:  # a second layer with another layout: one launch per layer
            layers[1]["x"] = layers[1]["x"].transpose(0, 1).contiguous().transpose(0, 1)
        ref_layers, ref_pending = _clone_all(layers, pending)
        width = path.shape[1]
        seqlen, ref_seqlen = torch.full((batch,), 9), torch.full((batch,), 9)
        for lens in ([4, 1, 2], [2, 3, 0], [3, 4, 4]):  # rows flush at different iterations
            path_len = torch.tensor(lens)
            SR.replay_states_layers(*_layers_args(layers), path, path_len, pending)
            naive_replay_states_layers(*_layers_args(ref_layers), path, path_len, ref_pending)
            SR.advance_positions(seqlen, pending[3], path_len, width, capacity)
            naive_advance_positions(ref_seqlen, ref_pending[3], path_len, width, capacity)
            assert torch.equal(seqlen, ref_seqlen) and torch.equal(pending[3], ref_pending[3])
            for got, want in zip(layers, ref_layers):
                assert torch.equal(got["conv_state"], want["conv_state"])
                assert_close(got["ssm_state"], want["ssm_state"], atol=1e-5, rtol=1e-5)
            count = pending[3].tolist()
            for kind in range(3):
                for got, want in zip(pending[kind], ref_pending[kind]):
                    for b in range(batch):  # the valid slots (past them the kernels may leave anything)
                        assert torch.equal(got[b, :count[b]], want[b, :count[b]])
        SR.settle_pending_layers([layer["ssm_state"] for layer in layers], [layer["A"] for layer in layers], pending)
        naive_settle_pending_layers([layer["ssm_state"] for layer in ref_layers], [layer["A"] for layer in ref_layers],
                                    ref_pending)
        for got, want in zip(layers, ref_layers):
            assert_close(got["ssm_state"], want["ssm_state"], atol=1e-5, rtol=1e-5, name="settled")

    @pytest.mark.parametrize("layers", [pytest.param(("mamba", "mamba"), marks=pytest.mark.slow),
                                        ("mamba", "attention", "mlp", "mamba")], ids=["mamba", "hybrid"])
    def test_model_with_pending_slots_matches_plain_cache_on_kernels(layers):
        _model_with_pending_matches_plain(layers, "triton")
