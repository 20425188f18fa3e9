"""The verify's in_proj with the tree conv in the skinny GEMM's epilogue (ops/tree_conv
`norm_linear_tree_conv`) against its reference, `naive_norm_linear` then `naive_tree_conv`.

Same arrangement as tests/test_ops_triton.py: the default run checks the dispatch tables and spawns
this file in a child process with TRITON_INTERPRET=1, where the kernel tests below run (fp32; bf16
at the mamba2-2.7b shape is in tests/gpu/test_verify_fused_gpu.py).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

from helpers import assert_close  # noqa: E402
from ssmspec.trees import Tree  # noqa: E402

TREES = {
    "one node": Tree.from_parents([-1]),
    "chain of 7": Tree.chain(7),
    "binary 2,2": Tree.from_config((2, 2)),
    "uneven 3,2,1": Tree.from_config((3, 2, 1)),  # 16 nodes
}
# (d_model, heads, head_dim, d_state, conv kernel): in_proj has 2 H P + 2 S + H output columns, the
# conv's inputs start at H P; the skinny GEMM's 32-column tiles straddle both ends of that range
SHAPES = [(32, 3, 8, 8, 4), (48, 5, 4, 6, 3)]


def _inputs(batch, tree, d_model, heads, head_dim, d_state, kernel_size, bias=True, dtype=torch.float32):
    d_inner = heads * head_dim
    conv_dim = d_inner + 2 * d_state
    n_out = d_inner + conv_dim + heads
    g = torch.Generator().manual_seed(batch * 1000 + tree.num_nodes)
    return {
        "x": torch.randn(batch, tree.num_nodes, d_model, generator=g, dtype=dtype),
        "weight": (torch.randn(n_out, d_model, generator=g) / d_model**0.5).to(dtype),
        "bias": torch.randn(n_out, generator=g).to(dtype) if bias else None,
        "norm_groups": 1,
        "eps": 1e-5,
        "x_sq": None,
        "conv_offset": d_inner,
        "conv_state": torch.randn(batch, conv_dim, kernel_size - 1, generator=g).to(dtype),
        "conv_weight": (torch.randn(conv_dim, kernel_size, generator=g) / 2).to(dtype),
        "conv_bias": torch.randn(conv_dim, generator=g).to(dtype) if bias else None,
        "parents": tree.parents_tensor(),
    }


if not INTERPRETED:

    def test_kernels_in_interpreter():
        from helpers import run_interpreted

        run_interpreted(__file__)

    def test_dispatch_tables():
        from ssmspec.ops import dispatch
        from ssmspec.ops.tree_conv.naive import naive_norm_linear_tree_conv

        assert dispatch._REFERENCE["norm_linear_tree_conv"] is naive_norm_linear_tree_conv
        assert dispatch._TRITON["norm_linear_tree_conv"] == ("ssmspec.ops.tree_conv.triton", "norm_linear_tree_conv")

else:
    from ssmspec.ops.gemv import triton as G
    from ssmspec.ops.tree_conv import triton as TC
    from ssmspec.ops.tree_conv.naive import naive_norm_linear_tree_conv

    @pytest.fixture
    def epilogue_calls(monkeypatch):
        """The tree_conv arguments skinny_linear received: whether the fused path ran."""
        calls, skinny = [], G.skinny_linear

        def spy(*args, **kwargs):
            calls.append(kwargs.get("tree_conv"))
            return skinny(*args, **kwargs)

        monkeypatch.setattr(G, "skinny_linear", spy)
        return calls

    def _check(v, epilogue_calls, fused):
        y, conv = TC.norm_linear_tree_conv(**v)
        want_y, want_conv = naive_norm_linear_tree_conv(**v)
        assert_close(y, want_y, atol=1e-5, rtol=1e-5, name="projection")
        assert_close(conv, want_conv, atol=1e-5, rtol=1e-5, name="conv")
        assert conv.shape == want_conv.shape and conv.dtype == want_conv.dtype
        assert (len(epilogue_calls) == 1 and epilogue_calls[0] is not None) == fused

    @pytest.mark.parametrize("tree_name", list(TREES))
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
    @pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
    def test_fused_matches_reference(tree_name, shape, bias, nan_outputs, epilogue_calls):
        tree = TREES[tree_name]
        v = _inputs(1, tree, *shape, bias=bias)
        _check(v, epilogue_calls, fused=tree.num_nodes > 1)  # one row: the GEMV, then the conv

    @pytest.mark.parametrize("tree_name", ["chain of 7", "binary 2,2"])
    def test_fused_batch_rows(tree_name, nan_outputs, epilogue_calls):
        """Two trees' rows in one tile: each row's window stays inside its own batch entry."""
        tree = TREES[tree_name]
        _check(_inputs(2, tree, *SHAPES[0]), epilogue_calls, fused=True)

    def test_wide_rows_fused_only_for_listed_shapes(monkeypatch, nan_outputs, epilogue_calls):
        """17..64 rows take the skinny GEMM (and so the fused conv) only for SKINNY_WIDE's shapes."""
        tree = Tree.from_config((3, 4, 2))  # 40 nodes
        v = _inputs(1, tree, *SHAPES[0])
        _check(v, epilogue_calls, fused=False)
        epilogue_calls.clear()
        n_out, d_model = v["weight"].shape
        monkeypatch.setitem(G.SKINNY_WIDE, (n_out, d_model), (32, 32, 4, 2))
        _check(v, epilogue_calls, fused=True)
