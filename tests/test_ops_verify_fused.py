"""The verify path's fused kernels (tree_scan_gated, replay_states[_layers]) against their references.

Same arrangement as tests/test_ops_triton.py: the default run checks the references against the
ops they fuse and spawns this file in a child process with TRITON_INTERPRET=1, where the kernel
tests below are defined and run (fp32, and bf16 only where the kernels copy or widen it exactly;
bf16 at model sizes is in tests/gpu).
"""
from __future__ import annotations

import math
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
    "binary 2,2,2": Tree.from_config((2, 2, 2)),
    "uneven 3,4,2,1": Tree.from_config((3, 4, 2, 1)),
}
# (batch, heads, head_dim, d_state, groups): odd head counts, two groups, sizes off powers of two
SHAPES = [(1, 3, 8, 16, 1), (2, 6, 12, 10, 2), (3, 5, 16, 24, 1)]
# (dt_min, dt_max): a clamp that bites on both sides, and none (softplus past its threshold 20)
CLAMPS = [(0.05, 1.5), (0.0, math.inf)]


def _verify_inputs(batch, n, heads, head_dim, d_state, groups, dtype=torch.float32):
    """Inputs as the model passes them: z and dt_raw are column slices of one in_proj output,
    x, B and C column slices of one conv output. Returns a dict of the op's arguments."""
    d_inner, conv_dim = heads * head_dim, heads * head_dim + 2 * groups * d_state
    proj = torch.randn(batch, n, d_inner + conv_dim + heads, dtype=dtype)
    proj[..., -heads:] *= 2
    proj[0, 0, -1] = 22.0  # past softplus's linear threshold
    z, xBC, dt_raw = proj.split([d_inner, conv_dim, heads], dim=-1)
    conv = torch.randn(batch, n, conv_dim, dtype=dtype)
    x, B, C = conv.split([d_inner, groups * d_state, groups * d_state], dim=-1)
    return {
        "x": x.unflatten(-1, (heads, head_dim)),  # (B, N, H, P)
        "dt_raw": dt_raw,  # (B, N, H)
        "dt_bias": torch.randn(heads) * 0.5 - 1,
        "A": -(0.5 + torch.rand(heads) * 2),
        "B": B.unflatten(-1, (groups, d_state)),  # (B, N, G, S)
        "C": C.unflatten(-1, (groups, d_state)),
        "D": torch.randn(heads),
        "z": z,  # (B, N, H*P)
        "initial_state": torch.randn(batch, heads, head_dim, d_state),
        "xBC": xBC,  # (B, N, conv_dim)
    }


def _replay_inputs(batch, n, heads, head_dim, d_state, groups, kernel_size, steps):
    v = _verify_inputs(batch, n, heads, head_dim, d_state, groups)
    conv_dim = v["xBC"].shape[-1]
    path = torch.randint(0, n, (batch, steps))
    lens = [steps, 0, max(1, steps // 2), 1][:batch]  # full, nothing accepted, partial
    return {
        "conv_state": torch.randn(batch, conv_dim, kernel_size - 1),
        "ssm_state": torch.randn(batch, heads, head_dim, d_state),
        "xBC": v["xBC"], "x": v["x"], "dt": torch.rand(batch, n, heads) * 0.5 + 0.01, "A": v["A"], "B": v["B"],
        "path": path, "path_len": torch.tensor(lens),
    }


def _gated_args(v, clamp, parents, with_D=True):
    return (v["x"], v["dt_raw"], v["dt_bias"], *clamp, v["A"], v["B"], v["C"], v["D"] if with_D else None, v["z"],
            parents, v["initial_state"])


def _replay_args(r):
    return (r["conv_state"], r["ssm_state"], r["xBC"], r["x"], r["dt"], r["A"], r["B"], r["path"], r["path_len"])


_LAYER_KEYS = ("conv_state", "ssm_state", "xBC", "x", "dt", "A", "B")


def _layers_inputs(n_layers, lens, dtype=torch.float32, steps=5, shape=(2, 6, 12, 10, 2), kernel_size=4):
    """Replay inputs of n_layers Mamba layers, each layer its own allocations of one layout (as
    a model holds them; activations in `dtype`, SSM states and dt fp32), one path per batch row
    with the valid lengths `lens`. Returns (per-layer dicts, path, path_len)."""
    heads, head_dim, d_state, groups = shape[1:]
    batch, n = len(lens), 12
    layers = []
    for _ in range(n_layers):
        v = _verify_inputs(batch, n, heads, head_dim, d_state, groups, dtype=dtype)
        layers.append({
            "conv_state": torch.randn(batch, v["xBC"].shape[-1], kernel_size - 1).to(dtype),
            "ssm_state": torch.randn(batch, heads, head_dim, d_state),
            "xBC": v["xBC"], "x": v["x"], "dt": torch.rand(batch, n, heads) * 0.5 + 0.01, "A": v["A"], "B": v["B"],
        })
    return layers, torch.randint(0, n, (batch, steps)), torch.tensor(lens)


def _layers_args(layers, path, path_len):
    """replay_states_layers' arguments: one list per tensor kind, then the shared path."""
    return (*([layer[k] for layer in layers] for k in _LAYER_KEYS), path, path_len)


def _cloned(layers):
    return [{k: t.clone() if k in ("conv_state", "ssm_state") else t for k, t in layer.items()} for layer in layers]


if not INTERPRETED:
    import torch.nn.functional as F

    from ssmspec.ops.state_replay.naive import (
        naive_replay_conv_state,
        naive_replay_ssm_state,
        naive_replay_states,
        naive_replay_states_layers,
    )
    from ssmspec.ops.step_update.naive import naive_time_step
    from ssmspec.ops.tree_scan.naive import naive_tree_scan, naive_tree_scan_gated

    def test_fused_kernels_in_interpreter():
        from helpers import run_interpreted

        run_interpreted(__file__)

    @pytest.mark.parametrize("clamp", CLAMPS, ids=["clamped", "unclamped"])
    @pytest.mark.parametrize("with_D", [True, False], ids=["D", "noD"])
    def test_naive_tree_scan_gated_is_time_step_scan_and_gate(clamp, with_D):
        tree = TREES["uneven 3,4,2,1"]
        parents = tree.parents_tensor()
        v = _verify_inputs(2, tree.num_nodes, 6, 12, 10, 2, dtype=torch.bfloat16)
        g, dt = naive_tree_scan_gated(*_gated_args(v, clamp, parents, with_D))
        want_dt = naive_time_step(v["dt_raw"], v["dt_bias"], *clamp)
        y = naive_tree_scan(v["x"], want_dt, v["A"], v["B"], v["C"], v["D"] if with_D else None, parents, v["initial_state"])
        want_g = (y.flatten(-2).to(torch.bfloat16).float() * F.silu(v["z"].float())).to(torch.bfloat16)
        assert dt.dtype == torch.float32 and g.dtype == torch.bfloat16 and g.shape == v["z"].shape
        assert torch.equal(dt, want_dt) and torch.equal(g, want_g)
        assert (dt >= clamp[0]).all() and (dt <= clamp[1]).all()

    def test_naive_replay_states_is_both_replays():
        r = _replay_inputs(3, 12, 5, 8, 16, 1, kernel_size=4, steps=5)
        conv, ssm = r["conv_state"].clone(), r["ssm_state"].clone()
        naive_replay_states(*_replay_args(r))
        naive_replay_conv_state(conv, r["xBC"], r["path"], r["path_len"])
        naive_replay_ssm_state(ssm, r["x"], r["dt"], r["A"], r["B"], r["path"], r["path_len"])
        assert torch.equal(r["conv_state"], conv) and torch.equal(r["ssm_state"], ssm)

    def test_dispatch_reference_backend_runs_the_references():
        from ssmspec.ops import dispatch, paths

        assert dispatch._REFERENCE["tree_scan_gated"] is naive_tree_scan_gated
        assert dispatch._REFERENCE["replay_states"] is naive_replay_states
        assert dispatch._REFERENCE["replay_states_layers"] is naive_replay_states_layers
        assert paths.TRITON_KERNELS["tree_scan_gated"] == ("ssmspec.ops.tree_scan.triton", "tree_scan_gated")
        assert paths.TRITON_KERNELS["replay_states"] == ("ssmspec.ops.state_replay.triton", "replay_states")
        assert paths.TRITON_KERNELS["replay_states_layers"] == ("ssmspec.ops.state_replay.triton", "replay_states_layers")

    def test_naive_replay_states_layers_is_each_layers_replay():
        layers, path, path_len = _layers_inputs(3, [5, 1])
        want = _cloned(layers)
        naive_replay_states_layers(*_layers_args(layers, path, path_len))
        for got, ref in zip(layers, want):
            naive_replay_states(*(ref[k] for k in _LAYER_KEYS), path, path_len)
            assert torch.equal(got["conv_state"], ref["conv_state"]) and torch.equal(got["ssm_state"], ref["ssm_state"])
        with pytest.raises(ValueError, match="per layer"):
            args = _layers_args(layers, path, path_len)
            naive_replay_states_layers(args[0][:2], *args[1:])

else:
    from ssmspec.ops import dispatch
    from ssmspec.ops.state_replay import triton as SR
    from ssmspec.ops.state_replay.naive import naive_replay_states
    from ssmspec.ops.tree_scan import triton as TS
    from ssmspec.ops.tree_scan.naive import naive_tree_scan, naive_tree_scan_gated

    @pytest.mark.parametrize("tree_name", list(TREES))
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
    @pytest.mark.parametrize("clamp", CLAMPS, ids=["clamped", "unclamped"])
    def test_tree_scan_gated_matches_reference(tree_name, shape, clamp, nan_outputs):
        tree = TREES[tree_name]
        v = _verify_inputs(shape[0], tree.num_nodes, *shape[1:])
        args = _gated_args(v, clamp, tree.parents_tensor())
        want_g, want_dt, want_sq = naive_tree_scan_gated(*args, return_sq=True)
        g, dt, sq = TS.tree_scan_gated(*args, return_sq=True)
        assert_close(dt, want_dt, atol=1e-6, rtol=1e-6, name=f"dt {tree_name}")
        assert_close(g, want_g, atol=1e-4, rtol=1e-4, name=f"g {tree_name}")
        assert g.dtype == v["z"].dtype and g.shape == v["z"].shape
        # the partial sums of squares for out_proj's gated norm: one part per head of the group
        batch, heads, groups = shape[0], shape[1], shape[4]
        assert sq.shape == (batch * tree.num_nodes, groups, heads // groups)
        assert_close(sq.sum(-1, keepdim=True), want_sq, atol=1e-3, rtol=1e-4, name=f"sq {tree_name}")

    def test_tree_scan_gated_without_D_contiguous_inputs_two_P_blocks(nan_outputs):
        """P = 72: two P-block programs per head (the second partial), only the first stores dt."""
        tree = TREES["binary 2,2,2"]
        v = _verify_inputs(2, tree.num_nodes, 4, 72, 16, 2)
        v = {k: t.contiguous() for k, t in v.items()}
        args = _gated_args(v, CLAMPS[0], tree.parents_tensor(), with_D=False)
        want_g, want_dt, want_sq = naive_tree_scan_gated(*args, return_sq=True)
        g, dt, sq = TS.tree_scan_gated(*args, return_sq=True)
        assert_close(dt, want_dt, atol=1e-6, rtol=1e-6, name="dt")
        assert_close(g, want_g, atol=1e-4, rtol=1e-4, name="g")
        assert sq.shape == (2 * tree.num_nodes, 2, 2 * 2)  # 2 heads per group x 2 P blocks
        assert_close(sq.sum(-1, keepdim=True), want_sq, atol=1e-3, rtol=1e-4, name="sq")

    def test_tree_scan_unchanged_beside_the_fused_switch(nan_outputs):
        tree = TREES["uneven 3,4,2,1"]
        v = _verify_inputs(2, tree.num_nodes, 5, 8, 16, 1)
        dt = torch.rand(2, tree.num_nodes, 5) * 0.5 + 0.01
        args = (v["x"], dt, v["A"], v["B"], v["C"], v["D"], tree.parents_tensor(), v["initial_state"])
        assert_close(TS.tree_scan(*args), naive_tree_scan(*args), atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
    @pytest.mark.parametrize("kernel_size", [2, 4, pytest.param(5, marks=pytest.mark.slow)])
    @pytest.mark.parametrize("steps", [5, 18], ids=["unrolled", "looped"])
    def test_replay_states_matches_reference(shape, kernel_size, steps):
        batch, heads, head_dim, d_state, groups = shape
        batch = 3  # rows: full, nothing accepted, partial
        # channels = H*P + 2*G*S: more than one 256-channel block for the larger shapes
        r = _replay_inputs(batch, 20, heads, head_dim, d_state, groups, kernel_size, steps)
        conv0, ssm0 = r["conv_state"].clone(), r["ssm_state"].clone()
        want = {**r, "conv_state": conv0.clone(), "ssm_state": ssm0.clone()}
        naive_replay_states(*_replay_args(want))
        SR.replay_states(*_replay_args(r))
        assert torch.equal(r["conv_state"], want["conv_state"])
        assert_close(r["ssm_state"], want["ssm_state"], atol=1e-5, rtol=1e-5, name="ssm_state")
        assert torch.equal(r["ssm_state"][1], ssm0[1]) and torch.equal(r["conv_state"][1], conv0[1]), \
            "a row with path_len 0 must keep its states"

    def test_replay_states_wide_conv_state():
        """Many channel blocks and a strided xBC (a column slice of in_proj), as at model sizes."""
        r = _replay_inputs(2, 9, 9, 56, 40, 1, kernel_size=4, steps=4)  # 584 channels
        assert r["xBC"].shape[-1] > 2 * 256 and r["xBC"].stride(-2) != r["xBC"].shape[-1]
        want = {**r, "conv_state": r["conv_state"].clone(), "ssm_state": r["ssm_state"].clone()}
        naive_replay_states(*_replay_args(want))
        SR.replay_states(*_replay_args(r))
        assert torch.equal(r["conv_state"], want["conv_state"])
        assert_close(r["ssm_state"], want["ssm_state"], atol=1e-5, rtol=1e-5, name="ssm_state")

    @pytest.mark.parametrize("lens", [(5,), (1,), (5, 1), (2, 5)], ids=["full", "root-only", "full+root", "partial+full"])
    @pytest.mark.parametrize("dtype, n_layers", [(torch.float32, 3), (torch.bfloat16, 2)], ids=["fp32-3", "bf16-2"])
    def test_replay_states_layers_matches_per_layer_reference(monkeypatch, lens, dtype, n_layers):
        """One launch over all layers (no per-layer fallback) equals each layer's naive replay;
        bf16: bf16 conv states and activations, as in a bf16 model (fp32 SSM states and dt)."""
        layers, path, path_len = _layers_inputs(n_layers, list(lens), dtype=dtype)
        want = _cloned(layers)
        for ref in want:
            naive_replay_states(*(ref[k] for k in _LAYER_KEYS), path, path_len)
        monkeypatch.setattr(SR, "replay_states", lambda *a: pytest.fail("fell back to per-layer launches"))
        SR.replay_states_layers(*_layers_args(layers, path, path_len))
        for i, (got, ref) in enumerate(zip(layers, want)):
            assert got["conv_state"].dtype == dtype and torch.equal(got["conv_state"], ref["conv_state"]), f"layer {i} conv"
            assert_close(got["ssm_state"], ref["ssm_state"], atol=1e-5, rtol=1e-5, name=f"layer {i} ssm_state")

    def test_replay_states_layers_wide_and_looped():
        """Two conv channel blocks (288 channels), a partial second head-dim block, K = 5 and
        18 steps (the looped path), with every layer read through layer 0's strides."""
        layers, path, path_len = _layers_inputs(2, [18, 7], steps=18, shape=(2, 5, 48, 24, 1), kernel_size=5)
        want = _cloned(layers)
        for ref in want:
            naive_replay_states(*(ref[k] for k in _LAYER_KEYS), path, path_len)
        SR.replay_states_layers(*_layers_args(layers, path, path_len))
        for i, (got, ref) in enumerate(zip(layers, want)):
            assert torch.equal(got["conv_state"], ref["conv_state"]), f"layer {i} conv"
            assert_close(got["ssm_state"], ref["ssm_state"], atol=1e-5, rtol=1e-5, name=f"layer {i} ssm_state")

    def test_replay_states_layers_falls_back_when_layouts_differ(monkeypatch):
        """A layer whose xBC is contiguous (other strides than layer 0's) cannot share one set of
        strides: each layer then gets its own replay_states launch, with the same result."""
        layers, path, path_len = _layers_inputs(3, [5, 2])
        layers[1]["xBC"] = layers[1]["xBC"].contiguous()
        want = _cloned(layers)
        for ref in want:
            naive_replay_states(*(ref[k] for k in _LAYER_KEYS), path, path_len)
        calls = []
        per_layer = SR.replay_states
        monkeypatch.setattr(SR, "replay_states", lambda *a: calls.append(1) or per_layer(*a))
        SR.replay_states_layers(*_layers_args(layers, path, path_len))
        assert len(calls) == 3
        for i, (got, ref) in enumerate(zip(layers, want)):
            assert torch.equal(got["conv_state"], ref["conv_state"]), f"layer {i} conv"
            assert_close(got["ssm_state"], ref["ssm_state"], atol=1e-5, rtol=1e-5, name=f"layer {i} ssm_state")

    def test_dispatch_triton_backend_runs_the_kernels(nan_outputs):
        with dispatch.use_backend("triton"):
            _dispatch_runs_the_kernels()

    def _dispatch_runs_the_kernels():
        assert dispatch.resolve("tree_scan_gated", torch.device("cpu")) is TS.tree_scan_gated
        assert dispatch.resolve("replay_states", torch.device("cpu")) is SR.replay_states
        assert dispatch.resolve("replay_states_layers", torch.device("cpu")) is SR.replay_states_layers
        tree = TREES["chain of 7"]
        v = _verify_inputs(1, tree.num_nodes, 3, 8, 16, 1)
        args = _gated_args(v, CLAMPS[0], tree.parents_tensor())
        for got, want in zip(dispatch.tree_scan_gated(*args), naive_tree_scan_gated(*args)):
            assert_close(got, want, atol=1e-4, rtol=1e-4)

    def test_step_may_keep_bf16_logits_on_the_kernel_path():
        # The fused draft asks its drafter for logits in the LM head's dtype (one cast launch fewer
        # per drafter step): the same numbers as the fp32 logits, which are their cast; the cache
        # advances the same either way.
        from helpers import kernel_shaped_model
        from ssmspec.ops import paths

        model = kernel_shaped_model()
        ids = torch.tensor([[3], [5]])
        with paths.use_backend("triton"), paths.use_stream_layers("off"), torch.inference_mode():
            caches = [model.new_cache(2, 16) for _ in range(2)]
            for cache in caches:
                model(torch.tensor([[1, 2, 4], [7, 6, 5]]), cache, last_only=True)
            kept = model.step(ids, caches[0], float_logits=False)
            cast = model.step(ids, caches[1])
        assert kept.dtype == torch.bfloat16 and cast.dtype == torch.float32
        assert torch.equal(kept.float(), cast)
        for a, b in zip(caches[0].layers, caches[1].layers):
            assert torch.equal(a.ssm_state, b.ssm_state) and torch.equal(a.conv_state, b.conv_state)
