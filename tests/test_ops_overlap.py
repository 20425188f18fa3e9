"""The verify layer with in_proj split in two (ops/overlap.py): z's GEMM raises ready counters as
it stores its tiles, the gated tree scan waits for them, and the split layer computes what the
plain one does.

Same arrangement as tests/test_ops_triton.py: the default run checks the policy on the reference
backend and spawns this file in a child process with TRITON_INTERPRET=1, where the kernel tests
run (the interpreter runs launches one after another, so the counters are always raised before
the scan reads them; the concurrent case is in tests/gpu).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

from helpers import assert_close, tiny_model  # noqa: E402
from ssmspec.ops import dispatch, overlap, paths  # noqa: E402
from ssmspec.trees import Tree  # noqa: E402


def _verify_both_ways(model, tokens, tree, monkeypatch):
    """model.verify with the plain layer and with the split one (split from 2 rows on), with a
    count of the layers that split."""
    splits = []
    real = overlap.split_in_proj_counters

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        splits.append(out is not None)
        return out

    monkeypatch.setattr(overlap, "split_in_proj_counters", spy)
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        model(tokens[:, :3], cache, last_only=True)
        monkeypatch.setattr(paths, "SPLIT_IN_PROJ_MIN_ROWS", 10**6)  # the plain layer at every size
        want, _ = model.verify(tokens[:, 3:], tree, cache)
        monkeypatch.setattr(paths, "SPLIT_IN_PROJ_MIN_ROWS", 2)
        splits.clear()
        got, _ = model.verify(tokens[:, 3:], tree, cache)
    return want, got, sum(splits)


if not INTERPRETED:

    def test_overlap_kernels_in_interpreter():
        from helpers import run_interpreted

        run_interpreted(__file__)

    def test_pending_slots_policy_follows_the_split(monkeypatch):
        """Slots for trees of up to 32 nodes; for 33-64 only where the target's verify splits."""
        from ssmspec.decoding.generate import PENDING_SLOTS, pending_slots_for

        model = tiny_model().fold_norm_weights_()
        small, large, huge = Tree.from_config((3, 2, 1)), Tree.from_config((3, 4, 2, 1)), Tree.chain(80)
        assert pending_slots_for(None, model) == 0
        assert pending_slots_for(small) == pending_slots_for(small, model) == PENDING_SLOTS
        assert pending_slots_for(large) == 0
        assert not model.verify_splits_in_proj(large.num_nodes)  # CPU, reference kernels
        assert pending_slots_for(large, model) == 0
        monkeypatch.setattr(type(model), "verify_splits_in_proj", lambda self, nodes, batch=1: True)
        assert pending_slots_for(large, model) == PENDING_SLOTS
        assert pending_slots_for(huge, model) == 0

    def test_reference_backend_never_splits(monkeypatch):
        monkeypatch.setattr(paths, "SPLIT_IN_PROJ_MIN_ROWS", 2)
        with dispatch.use_backend("reference"):
            assert overlap.split_in_proj_counters(64, 1, 32, 68, 32, 4, 4, 8, torch.device("cpu")) is None

else:
    from ssmspec.ops.gemv.triton import skinny_linear
    from ssmspec.ops.tree_scan.naive import naive_tree_scan_gated
    from ssmspec.ops.tree_scan.triton import gate_readers, tree_scan_gated

    @pytest.fixture(autouse=True)
    def _triton_backend():
        with dispatch.use_backend("triton"):
            yield

    @pytest.mark.parametrize("rows, n, unit", [(5, 96, 8), (16, 64, 32)])
    def test_skinny_linear_raises_ready_counters_per_column_block(rows, n, unit):
        x, w = torch.randn(rows, 48), torch.randn(n, 48)
        counters = torch.zeros(n // unit + 2, dtype=torch.int32)  # two past the end stay untouched
        got = skinny_linear(x, w, config=(32, 16, 4, 2), ready_flags=(counters, unit, 3))
        assert_close(got, skinny_linear(x, w, config=(32, 16, 4, 2)), atol=0, rtol=0, name="output")
        assert counters.tolist() == [3] * (n // unit) + [0, 0]

    def test_ready_counters_need_whole_blocks_per_tile():
        x, w = torch.randn(4, 48), torch.randn(96, 48)
        counters = torch.zeros(8, dtype=torch.int32)
        with pytest.raises(ValueError, match="multiple"):
            skinny_linear(x, w, config=(32, 16, 4, 2), ready_flags=(counters, 12, 1))  # 32 % 12
        with pytest.raises(ValueError, match="multiple"):
            skinny_linear(x, w, config=(0, 16, 4, 2, 1), ready_flags=(counters, 8, 1))  # balanced grid

    @pytest.mark.parametrize("batch, heads, head_dim", [(1, 4, 8), (2, 3, 16)])
    def test_gated_scan_waits_for_counters_and_leaves_them_at_zero(batch, heads, head_dim):
        tree = Tree.from_config((2, 2))
        n, d_state, groups = tree.num_nodes, 16, 1
        x = torch.randn(batch, n, heads, head_dim)
        dt_raw, dt_bias = torch.randn(batch, n, heads), torch.rand(heads)
        A, D = -(0.5 + torch.rand(heads)), torch.randn(heads)
        B, C = torch.randn(batch, n, groups, d_state), torch.randn(batch, n, groups, d_state)
        z = torch.randn(batch, n, heads * head_dim)
        h0 = torch.randn(batch, heads, head_dim, d_state)
        parents = tree.parents_tensor("cpu")
        args = (x, dt_raw, dt_bias, 0.0, float("inf"), A, B, C, D, z, parents, h0)
        counters = torch.full((heads,), gate_readers(batch, head_dim), dtype=torch.int32)
        g, dt, sq = tree_scan_gated(*args, return_sq=True, gate_flags=counters)
        g_plain, dt_plain, sq_plain = tree_scan_gated(*args, return_sq=True)
        assert torch.equal(g, g_plain) and torch.equal(dt, dt_plain) and torch.equal(sq, sq_plain)
        g_ref, _ = naive_tree_scan_gated(*args)
        assert_close(g, g_ref, atol=1e-4, rtol=1e-4, name="gated output")
        assert counters.tolist() == [0] * heads
        with pytest.raises(ValueError, match="int32"):
            tree_scan_gated(*args, gate_flags=counters.long())

    @pytest.mark.parametrize("layers", [("mamba", "mamba"), ("mamba", "attention", "mlp", "mamba")],
                             ids=["mamba", "hybrid"])
    def test_split_verify_layer_equals_plain_layer(layers, monkeypatch):
        model = tiny_model(layers).fold_norm_weights_()
        tree = Tree.from_config((3, 2))
        tokens = torch.randint(0, 64, (1, 3 + tree.num_nodes))
        want, got, splits = _verify_both_ways(model, tokens, tree, monkeypatch)
        assert splits == sum(kind == "mamba" for kind in layers)  # every Mamba layer took the split path
        assert_close(got, want, atol=1e-5, rtol=1e-5, name="verify logits")
        assert not overlap.ready_counters(torch.device("cpu"), model.config.mamba.n_heads).any()

    def test_counters_are_reset_when_the_scan_fails(monkeypatch):
        """z's GEMM has raised the counters; if the scan then fails, no later scan may find them
        raised (it would read a stale z)."""
        model = tiny_model().fold_norm_weights_()
        tree = Tree.from_config((2, 2))
        tokens = torch.randint(0, 64, (1, 3 + tree.num_nodes))
        cache = model.new_cache(1, 32)
        with torch.no_grad():
            model(tokens[:, :3], cache, last_only=True)
        monkeypatch.setattr(paths, "SPLIT_IN_PROJ_MIN_ROWS", 2)

        def failing_scan(*args, **kwargs):
            assert kwargs.get("gate_flags") is not None and kwargs["gate_flags"].any()  # raised by z's GEMM
            raise RuntimeError("scan failed")

        monkeypatch.setattr(dispatch, "tree_scan_gated", failing_scan)
        with torch.no_grad(), pytest.raises(RuntimeError, match="scan failed"):
            model.verify(tokens[:, 3:], tree, cache)
        assert not overlap.ready_counters(torch.device("cpu"), model.config.mamba.n_heads).any()
