"""Triton kernels against their naive references on the CPU, through Triton's interpreter.

Triton picks the interpreter when it is imported (its own library functions are decorated then)
and when each kernel is decorated, both from TRITON_INTERPRET. Setting that variable inside this
process would change Triton for every other test module, so the default run has one test that
runs this same file in a child process with TRITON_INTERPRET=1; there the kernel tests below are
defined and run. fp32 only: the interpreter's bf16 conversion does not round like the GPU (bf16
is covered by tests/gpu/test_ops_gpu.py).
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _tiny_model_with_head_dim(layers, head_dim):
    """helpers.tiny_model with another Mamba head size (16 takes the folded out_proj path)."""
    import dataclasses

    from helpers import tiny_config
    from ssmspec.models import LanguageModel, MambaConfig
    from ssmspec.models.init import init_weights

    cfg = dataclasses.replace(tiny_config(layers), mamba=MambaConfig(n_heads=4, head_dim=head_dim, d_state=8, n_groups=2,
                                                                     chunk_size=8))
    return init_weights(LanguageModel(cfg), seed=0, std=0.2).eval()


if not INTERPRETED:
    from helpers import assert_close

    def test_triton_kernels_in_interpreter():
        from helpers import run_interpreted

        run_interpreted(__file__)

    def test_interpreter_setting_does_not_leak():
        """This process keeps compiled (not interpreted) kernels: the child's setting stayed there."""
        import triton

        from ssmspec.ops.tree_scan import triton as kernels

        assert isinstance(kernels._tree_scan_kernel, triton.runtime.JITFunction)

    def test_greedy_tree_iteration_matches_step_decoding():
        """GreedyTreeGraph's device-side acceptance, run eagerly on the CPU (capture=False):
        full, partial and no acceptance, against greedy step-by-step decoding of a tiny model."""
        from helpers import tiny_model
        from ssmspec.decoding.graphs import GreedyTreeGraph
        from ssmspec.trees import Tree

        model = tiny_model()
        prompt = torch.randint(0, 64, (1, 6))
        tree = Tree.from_config((2, 2, 1))
        first_path = tree.path(max(range(tree.num_nodes), key=lambda i: (tree.depths[i], -i)))

        def fresh_cache():
            cache = model.new_cache(1, 64)
            with torch.no_grad():
                model(prompt, cache)
            return cache

        root = int(prompt[0, -1])
        work, tok, chain = fresh_cache(), torch.tensor([[root]]), []
        with torch.no_grad():
            for _ in range(tree.max_depth + 1):
                tok = model.step(tok, work).argmax(-1)
                chain.append(int(tok))
        for accept in (3, 1, 0):
            tokens = torch.randint(0, 64, (1, tree.num_nodes))
            tokens[0, 0] = root
            for d, node in enumerate(first_path[1:]):
                tokens[0, node] = chain[d] if d < accept else (chain[d] + 1) % 64
            # siblings must not match by chance, or the expected path would differ
            for node in range(1, tree.num_nodes):
                if node not in first_path:
                    tokens[0, node] = (chain[tree.depths[node] - 1] + 2) % 64
            cache = fresh_cache()
            out, n = GreedyTreeGraph(model, cache, tree, capture=False)(tokens)
            assert int(n[0]) == accept + 1
            assert out[0, : accept + 1].tolist() == chain[: accept + 1]
            assert int(cache.seqlen[0]) == prompt.shape[1] + accept + 1
            # the cache equals decoding root + accepted tokens one by one
            ref = fresh_cache()
            with torch.no_grad():
                for t in [root] + chain[:accept]:
                    model.step(torch.tensor([[t]]), ref)
            for mine, theirs in zip(cache.layers, ref.layers):
                assert_close(mine.ssm_state, theirs.ssm_state, atol=1e-5, rtol=1e-4, name=f"accept {accept}")
                assert_close(mine.conv_state, theirs.conv_state, atol=1e-6, rtol=1e-6, name=f"accept {accept}")

else:
    from helpers import assert_close
    from ssmspec.ops.causal_conv import triton as CC
    from ssmspec.ops.causal_conv.naive import naive_causal_conv
    from ssmspec.ops.chunk_scan import triton as CS
    from ssmspec.ops.chunk_scan.naive import naive_chunk_scan
    from ssmspec.ops.state_replay import triton as SR
    from ssmspec.ops.state_replay.naive import naive_replay_conv_state, naive_replay_ssm_state
    from ssmspec.ops.step_update import triton as SU
    from ssmspec.ops.step_update.naive import naive_gated_rms_norm, naive_mamba_step, naive_rms_norm, naive_time_step
    from ssmspec.ops.tree_conv import triton as TC
    from ssmspec.ops.tree_conv.naive import naive_tree_conv
    from ssmspec.ops.tree_scan import triton as TS
    from ssmspec.ops.tree_scan.naive import naive_tree_scan
    from ssmspec.ops.gemv import triton as GV
    from ssmspec.trees import Tree

    TREES = {
        "one node": Tree.from_parents([-1]),
        "chain of 63": Tree.chain(63),
        "binary depth 3": Tree.from_config((2, 2, 2)),
        "wide 9": Tree.from_config((9,)),
        "uneven": Tree.from_parents([-1, 0, 0, 1, 3, 3, 2, 6, 0, 4]),
        "three levels of 3 (40 nodes)": Tree.from_config((3, 3, 3)),
    }
    # (batch, heads, head_dim, d_state, groups): odd head counts, several groups, sizes off powers of two
    SHAPES = [(1, 3, 8, 16, 1), (2, 6, 12, 10, 3)]


    def _scan_inputs(batch, n, heads, head_dim, d_state, groups):
        x = torch.randn(batch, n, heads, head_dim)
        dt = torch.rand(batch, n, heads) * 0.5 + 0.01
        A = -(0.5 + torch.rand(heads) * 2)
        B = torch.randn(batch, n, groups, d_state)
        C = torch.randn(batch, n, groups, d_state)
        D = torch.randn(heads)
        h0 = torch.randn(batch, heads, head_dim, d_state)
        return x, dt, A, B, C, D, h0


    @pytest.mark.parametrize("tree_name", list(TREES))
    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
    def test_tree_scan_matches_reference(tree_name, shape, nan_outputs):
        tree = TREES[tree_name]
        parents = tree.parents_tensor()
        x, dt, A, B, C, D, h0 = _scan_inputs(shape[0], tree.num_nodes, *shape[1:])
        want = naive_tree_scan(x, dt, A, B, C, D, parents, h0)
        assert_close(TS.tree_scan(x, dt, A, B, C, D, parents, h0), want, atol=1e-4, rtol=1e-4, name=f"tree_scan {tree_name}")


    @pytest.mark.parametrize("parents", [
        list(range(-1, 63)),  # a 64-token prefill chunk: the lower-triangle mask
        list(range(-1, 39)),  # a chain in a padded block
        list(range(-1, 62)) + [0],  # a chain but the last node: the walk
        [-1, 0, 1, 2, 2, 4, 5, 6],  # a fork midway: the walk
        [-1, 0, 0],  # two children of the root
    ], ids=["chain-64", "chain-40", "chain-then-fork-at-root", "fork-midway", "root-with-two"])
    def test_tree_scan_ancestor_mask_of_chains_and_trees(parents, nan_outputs):
        """Chains take the lower-triangle ancestor mask, every other tree the parent walk: both
        give the reference's outputs, plain and gated (a tree taken for a chain would not)."""
        from ssmspec.ops.tree_scan.naive import naive_tree_scan_gated

        parents = torch.tensor(parents)
        n = len(parents)
        x, dt, A, B, C, D, h0 = _scan_inputs(1, n, 3, 8, 16, 1)
        z, bias = torch.randn(1, n, 24), torch.randn(3)
        assert_close(TS.tree_scan(x, dt, A, B, C, D, parents, h0), naive_tree_scan(x, dt, A, B, C, D, parents, h0),
                     atol=1e-4, rtol=1e-4, name="plain")
        got = TS.tree_scan_gated(x, dt, bias, 0.01, 5.0, A, B, C, D, z, parents, h0)[0]
        want = naive_tree_scan_gated(x, dt, bias, 0.01, 5.0, A, B, C, D, z, parents, h0)[0]
        assert_close(got, want, atol=1e-4, rtol=1e-4, name="gated")


    @pytest.mark.parametrize("block_s", [16, 32], ids=["3-chunks", "2-chunks"])
    def test_tree_scan_over_state_chunks(block_s, nan_outputs, monkeypatch):
        """A state wider than one chunk (the looped C.B / C.h0 products) matches the reference,
        plain and gated."""
        from ssmspec.ops.tree_scan.naive import naive_tree_scan_gated

        monkeypatch.setattr(TS, "SCAN_BLOCK_S", block_s)
        tree = TREES["uneven"]
        parents = tree.parents_tensor()
        x, dt, A, B, C, D, h0 = _scan_inputs(1, tree.num_nodes, 3, 8, 40, 1)
        assert_close(TS.tree_scan(x, dt, A, B, C, D, parents, h0), naive_tree_scan(x, dt, A, B, C, D, parents, h0),
                     atol=1e-4, rtol=1e-4, name=f"chunks of {block_s}")
        z, bias = torch.randn(1, tree.num_nodes, 24), torch.randn(3)
        got = TS.tree_scan_gated(x, dt, bias, 0.01, 5.0, A, B, C, D, z, parents, h0)
        want = naive_tree_scan_gated(x, dt, bias, 0.01, 5.0, A, B, C, D, z, parents, h0)
        assert_close(got[0], want[0], atol=1e-4, rtol=1e-4, name="gated")
        assert_close(got[1], want[1], atol=1e-6, rtol=1e-6, name="dt")


    def test_tree_scan_without_D_and_strided_inputs(nan_outputs):
        tree = TREES["uneven"]
        n = tree.num_nodes
        # x, B, C as views into one packed projection, as the model passes them
        packed = torch.randn(2, n, 4 * 8 + 2 * 2 * 16)
        x = packed[..., :32].unflatten(-1, (4, 8))
        B = packed[..., 32:64].unflatten(-1, (2, 16))
        C = packed[..., 64:].unflatten(-1, (2, 16))
        dt = torch.rand(2, n, 4)
        A = -torch.rand(4) - 0.1
        h0 = torch.randn(2, 4, 8, 16)
        want = naive_tree_scan(x, dt, A, B, C, None, tree.parents_tensor(), h0)
        assert_close(TS.tree_scan(x, dt, A, B, C, None, tree.parents_tensor(), h0), want, atol=1e-4, rtol=1e-4)


    @pytest.mark.parametrize("tree_name", list(TREES))
    @pytest.mark.parametrize("kernel_size", [2, 4, pytest.param(5, marks=pytest.mark.slow)])
    def test_tree_conv_matches_reference(tree_name, kernel_size, nan_outputs):
        tree = TREES[tree_name]
        batch, channels = 2, 300  # more channels than one block, not a multiple of it
        xbc = torch.randn(batch, tree.num_nodes, channels)
        state = torch.randn(batch, channels, kernel_size - 1)
        weight = torch.randn(channels, kernel_size)
        bias = torch.randn(channels) if kernel_size != 5 else None
        parents = tree.parents_tensor()
        want = naive_tree_conv(xbc, state, weight, bias, parents)
        assert_close(TC.tree_conv(xbc, state, weight, bias, parents), want, atol=1e-5, rtol=1e-5, name=tree_name)


    @pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
    def test_replay_ssm_state_matches_reference(shape):
        batch, heads, head_dim, d_state, groups = shape
        batch = 3
        n, steps = 12, 5
        x, dt, A, B, _, _, h0 = _scan_inputs(batch, n, heads, head_dim, d_state, groups)
        path = torch.randint(0, n, (batch, steps))
        path_len = torch.tensor([steps, 0, 2])  # full, nothing accepted, partial
        want, got = h0.clone(), h0.clone()
        naive_replay_ssm_state(want, x, dt, A, B, path, path_len)
        SR.replay_ssm_state(got, x, dt, A, B, path, path_len)
        assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got[1], h0[1]), "a row with path_len 0 must keep its state"


    @pytest.mark.parametrize("kernel_size", [2, 4, 5])
    def test_replay_conv_state_matches_reference(kernel_size):
        batch, n, channels, steps = 4, 9, 300, 6
        state = torch.randn(batch, channels, kernel_size - 1)
        xbc = torch.randn(batch, n, channels)
        path = torch.randint(0, n, (batch, steps))
        path_len = torch.tensor([steps, 0, 1, 3])
        want, got = state.clone(), state.clone()
        naive_replay_conv_state(want, xbc, path, path_len)
        SR.replay_conv_state(got, xbc, path, path_len)
        assert torch.equal(got, want)


    @pytest.mark.parametrize("shape", [(1, 4, 8, 16, 1, 1, 4), (2, 6, 16, 8, 3, 3, 3), (3, 6, 8, 16, 2, 1, 2)],
                             ids=["G1", "G3-norm3", "G2-norm1-K2"])
    def test_mamba_step_matches_reference(shape, nan_outputs):
        batch, heads, head_dim, d_state, groups, norm_groups, kernel_size = shape
        channels = heads * head_dim + 2 * groups * d_state
        xbc = torch.randn(batch, channels)
        dt_raw = torch.randn(batch, heads)
        z = torch.randn(batch, heads * head_dim)
        conv_state = torch.randn(batch, channels, kernel_size - 1)
        ssm_state = torch.randn(batch, heads, head_dim, d_state)
        args = (torch.randn(channels, kernel_size), torch.randn(channels), torch.randn(heads), torch.randn(heads),
                torch.randn(heads), torch.randn(heads * head_dim), groups, norm_groups, 0.01, 5.0, 1e-5)
        cs_want, ss_want = conv_state.clone(), ssm_state.clone()
        want = naive_mamba_step(xbc, dt_raw, z, cs_want, ss_want, *args)
        got = SU.mamba_step(xbc, dt_raw, z, conv_state, ssm_state, *args)
        assert_close(got, want, atol=1e-4, rtol=1e-4, name="out")
        assert_close(ssm_state, ss_want, atol=1e-5, rtol=1e-5, name="ssm_state")
        assert torch.equal(conv_state, cs_want), "conv state shift differs"


    def test_rms_norm_matches_reference(nan_outputs):
        h = torch.randn(3, 2, 5000)  # longer than one block
        w = torch.randn(5000)
        assert_close(SU.rms_norm(h, w, 1e-5), naive_rms_norm(h, w, 1e-5), atol=1e-5, rtol=1e-5)


    # By default two of the six stacks (together: batch 1 and 2, P 8 and 16, attention, folded and
    # not); the rest with --run-slow (each is ~20 s in the interpreter).
    _MODEL_STACKS = {"mamba": (("mamba", "mamba"), 2, 8), "hybrid": (("mamba", "mlp", "attention", "mlp", "mamba"), 2, 8),
                     "batch1-P16": (("mamba", "mlp", "mamba"), 1, 16)}
    _DEFAULT_STACKS = {"hybrid-norm-kernels", "batch1-P16-folded-norms"}

    @pytest.mark.parametrize("layers, batch, head_dim, folded", [
        pytest.param(*stack, folded, id=f"{name}-{fid}",
                     marks=() if f"{name}-{fid}" in _DEFAULT_STACKS else pytest.mark.slow)
        for folded, fid in ((False, "norm-kernels"), (True, "folded-norms")) for name, stack in _MODEL_STACKS.items()])
    def test_model_step_and_verify_through_kernels_match_reference(monkeypatch, layers, batch, head_dim, folded):
        """The fused step (residual adds inside the next norm, GEMV projections) and the tree
        verify+replay through the kernels equal the reference, for Mamba-only and hybrid stacks;
        folded: the kernels on the model with its norm weights folded (norms and residual adds
        inside the projections) against the reference on the original model."""
        from ssmspec.ops import dispatch

        kernels = {"tree_scan": TS.tree_scan, "tree_conv": TC.tree_conv, "mamba_step": SU.mamba_step, "rms_norm": SU.rms_norm,
                   "gated_rms_norm": SU.gated_rms_norm, "time_step": SU.time_step, "linear": GV.linear,
                   "add_rms_norm": SU.add_rms_norm, "mamba_step_out": SU.mamba_step_out,
                   "norm_linear": GV.norm_linear, "tree_scan_gated": TS.tree_scan_gated, "replay_states": SR.replay_states,
                   "replay_states_layers": SR.replay_states_layers}
        model = _tiny_model_with_head_dim(layers, head_dim)
        prompt = torch.randint(0, 64, (batch, 5))
        tree = Tree.from_config((2, 2))
        tokens = torch.randint(0, 64, (batch, tree.num_nodes))
        path = torch.tensor([[0, 1, 3], [0, 2, 6]])[:batch]
        path_len = torch.tensor([3, 2])[:batch]

        def run():
            cache = model.new_cache(batch, 32)
            with torch.no_grad():
                model(prompt, cache)
                step_logits = model.step(prompt[:, -1:], cache)
                tree_logits, acts = model.verify(tokens, tree, cache)
                model.replay(cache, acts, path, path_len)
            return step_logits, tree_logits, cache

        ref = run()
        monkeypatch.setattr(dispatch, "resolve", lambda op, device: kernels.get(op, dispatch._REFERENCE[op]))
        if folded:  # the same function with the norm weights in the projections: the fused-norm routes
            model.fold_norm_weights_()
        got = run()
        assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4, name="step logits")
        assert_close(got[1], ref[1], atol=1e-4, rtol=1e-4, name="tree logits")
        for kind, mine, theirs in zip(layers, got[2].layers, ref[2].layers):
            if kind == "mamba":
                assert_close(mine.ssm_state, theirs.ssm_state, atol=1e-5, rtol=1e-4, name="ssm_state")
                assert_close(mine.conv_state, theirs.conv_state, atol=1e-5, rtol=1e-5, name="conv_state")
            elif kind == "attention":
                assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-4, name="keys")
                assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-4, name="values")
        assert torch.equal(got[2].seqlen, ref[2].seqlen)

    def test_gated_rms_norm_matches_reference(nan_outputs):
        y = torch.randn(2, 3, 48)
        z = torch.randn(2, 3, 48)
        w = torch.randn(48)
        for group_size in (48, 16, 12):
            assert_close(SU.gated_rms_norm(y, z, w, group_size, 1e-5), naive_gated_rms_norm(y, z, w, group_size, 1e-5),
                         atol=1e-5, rtol=1e-5, name=f"group {group_size}")
        # y in fp32 with z in bf16: rounded to bf16 first (the scan's output feeding the norm)
        yb, zb, wb = torch.randn(2, 64), torch.randn(2, 64).bfloat16(), torch.randn(64).bfloat16()
        assert_close(SU.gated_rms_norm(yb, zb, wb, 32, 1e-5), naive_gated_rms_norm(yb, zb, wb, 32, 1e-5), atol=0.1, rtol=0.02)
        # groups longer than one chunk (1024): several programs per group
        y, z, w = torch.randn(2, 5000), torch.randn(2, 5000), torch.randn(5000)
        assert_close(SU.gated_rms_norm(y, z, w, 2500, 1e-5), naive_gated_rms_norm(y, z, w, 2500, 1e-5), atol=1e-5, rtol=1e-5)

    @pytest.mark.parametrize("steps, groups, head_dim, initial, chunk", [(1, 1, 16, True, 64), (20, 2, 32, False, 16),
                                                                       (63, 1, 16, True, 64), (130, 2, 16, True, 32)])
    def test_chunk_scan_forward_matches_reference(nan_outputs, monkeypatch, steps, groups, head_dim, initial, chunk):
        """The forward-only scan against naive_chunk_scan: one token, lengths off and across the
        kernel's chunks (of 16 here), two groups, with and without an initial state and D; x a
        slice of a wider tensor; 16-bit inputs within their tolerance."""
        from test_training_scan import scan_inputs

        monkeypatch.setattr(CS, "TILE", (16, 16, 4, 1))
        monkeypatch.setattr(CS, "FP32_TILE", (16, 16, 4, 1))
        x, dt, A, B, C, D, h0 = [None if t is None else t.detach() for t in
                                 scan_inputs(2, steps, 4, head_dim, groups, 16, initial=initial)]
        x = torch.cat([x, x], dim=-1)[..., :head_dim]  # unit channel stride, a wider head stride
        for d in (D, None):
            want_y, want_f = naive_chunk_scan(x, dt, A, B, C, d, chunk, h0)
            got_y, got_f = CS.chunk_scan_forward(x, dt, A, B, C, d, chunk, h0)
            assert_close(got_y, want_y, atol=1e-4, rtol=1e-4, name="y")
            assert_close(got_f, want_f, atol=1e-4, rtol=1e-4, name="final state")
        # 16-bit inputs: fp16 here (the interpreter's bf16 tl.dot is wrong, Triton 3.9), bf16 on the GPU
        xh, Bh, Ch = x.half(), B.half(), C.half()
        want_y, want_f = naive_chunk_scan(xh, dt, A, Bh, Ch, D, chunk, h0)
        got_y, got_f = CS.chunk_scan_forward(xh, dt, A, Bh, Ch, D, chunk, h0)
        assert got_y.dtype == torch.float16
        assert_close(got_y.float(), want_y, atol=1e-2, rtol=1e-2, name="y fp16")
        assert_close(got_f, want_f, atol=1e-2, rtol=1e-2, name="final state fp16")

    @pytest.mark.parametrize("T,size,heads", [(1, 8, 3), (29, 8, 11), (64, 16, 8), (40, 12, 5)])
    def test_ssd_decay_grad_matches_reference(nan_outputs, T, size, heads):
        """The SSD backward's last step: one token, a partial last chunk, a chunk off a power of two
        (its block's padding must not be stored: the next chunk's slots, conftest's write-apart
        check), heads across programs (8 a program); dt a slice of a wider tensor."""
        from test_chunk_scan_decay_grad import decay_grad_pieces

        from ssmspec.ops.chunk_scan.decay_grad import decay_grad, decay_grad_reference

        pieces = list(decay_grad_pieces(2, T, heads, size, seed=T))
        pieces[5] = torch.cat([pieces[5], pieces[5]], dim=-1)[..., :heads]  # dt: unit head stride, wider token stride
        want_ddt, want_dA = decay_grad_reference(*pieces)
        got_ddt, got_dA = decay_grad(*pieces)
        assert_close(got_ddt, want_ddt, atol=1e-5, rtol=1e-5, name="ddt")
        assert_close(got_dA, want_dA, atol=1e-4, rtol=1e-5, name="dA")

    @pytest.mark.parametrize("steps,chunk", [(1, 16), (40, 32), (64, 32), (70, 64)])
    def test_chunk_scan_forward_keeping_matches_reference(nan_outputs, monkeypatch, steps, chunk):
        """The training forward's kept tensors: the cumulated log-decays and dt per chunk, the state
        entering each chunk (the final state of the prefix before it), C B^T within each chunk on and
        below the diagonal blocks (zeros above); y and the final state as `chunk_scan_forward`'s."""
        from test_training_scan import scan_inputs

        monkeypatch.setattr(CS, "FP32_TILE", (16, 16, 4, 1))
        x, dt, A, B, C, D, _ = [None if t is None else t.detach() for t in scan_inputs(2, steps, 4, 16, 2, 16)]
        y, final, cum, dtc, states, CB = CS.chunk_scan_forward_keeping(x, dt, A, B, C, D, chunk)
        want_y, want_f = naive_chunk_scan(x, dt, A, B, C, D, chunk)
        assert_close(y, want_y, atol=1e-4, rtol=1e-4, name="y")
        assert_close(final, want_f, atol=1e-4, rtol=1e-4, name="final state")
        chunks = -(-steps // chunk)
        pad = lambda t: torch.nn.functional.pad(t, [0, 0] * (t.dim() - 2) + [0, chunks * chunk - steps])  # noqa: E731
        dt_chunked = pad(dt).unflatten(1, (chunks, chunk)).permute(0, 3, 1, 2)  # (batch, heads, chunks, chunk)
        assert_close(dtc, dt_chunked, atol=0, rtol=0, name="dt per chunk")
        assert_close(cum, (dt_chunked * A[:, None, None]).cumsum(-1), atol=1e-5, rtol=1e-5, name="cumulated decays")
        for c in range(chunks):
            entering = naive_chunk_scan(x[:, :c * chunk], dt[:, :c * chunk], A, B[:, :c * chunk], C[:, :c * chunk], D,
                                        chunk)[1] if c else torch.zeros_like(final)
            assert_close(states[:, c], entering, atol=1e-4, rtol=1e-4, name=f"state entering chunk {c}")
        Bc, Cc = (pad(t).unflatten(1, (chunks, chunk)) for t in (B, C))  # (batch, chunks, chunk, groups, d_state)
        want_CB = torch.einsum("bcign,bcjgn->bcgij", Cc, Bc)
        lower = (torch.arange(chunk)[:, None] // 16) >= (torch.arange(chunk)[None, :] // 16)  # on or below the blocks
        assert_close(CB * lower, want_CB * lower, atol=1e-4, rtol=1e-4, name="C B^T")
        assert torch.all(CB[..., ~lower] == 0)

    @pytest.mark.parametrize("T", [1, 2, 37, 70])
    def test_causal_conv_matches_reference(nan_outputs, T):
        """Lengths below K-1, inside one token block and across blocks; 150 channels (a partial
        block); xBC a slice of a wider projection (its token stride is not C); with and without
        the conv state and the bias."""
        g = torch.Generator().manual_seed(T)
        B, C, K = 2, 150, 4
        xBC = torch.randn(B, T, C + 20, generator=g)[..., 10 : 10 + C]
        weight, bias = torch.randn(C, K, generator=g), torch.randn(C, generator=g)
        state = torch.randn(B, C, K - 1, generator=g)
        for conv_state in (None, state):
            for b in (None, bias):
                assert_close(CC.causal_conv(xBC, conv_state, weight, b), naive_causal_conv(xBC, conv_state, weight, b),
                             atol=1e-5, rtol=1e-5, name=f"T {T}, state {conv_state is not None}, bias {b is not None}")

    @pytest.mark.parametrize("B, T, C, bias, spans", [(2, 37, 70, True, (16, 16)), (1, 130, 96, False, (64, 64)),
                                                     (2, 1, 40, True, (16, 64)), (2, 63, 150, True, (32, 16)),
                                                     (1, 100, 96, True, (16, 64))])
    def test_causal_conv_train_matches_reference_both_ways(nan_outputs, monkeypatch, B, T, C, bias, spans):
        """The training conv's forward and its gradients for x, the taps and the bias against
        autograd through naive_causal_conv; lengths off the span, below K, a partial channel
        block; x a slice of a wider projection; forward and backward walks of equal and unequal spans."""
        monkeypatch.setattr(CC, "FORWARD_WINDOW", (spans[0], 64, 4))
        monkeypatch.setattr(CC, "BACKWARD_WINDOW", (spans[1], 64, 4))
        g = torch.Generator().manual_seed(T)
        x = torch.randn(B, T, C + 9, generator=g)[..., 4 : 4 + C].requires_grad_()
        w = (0.5 * torch.randn(C, 4, generator=g)).requires_grad_()
        b = (0.3 * torch.randn(C, generator=g)).requires_grad_() if bias else None
        gy = torch.randn(B, T, C, generator=g)
        leaves = [t for t in (x, w, b) if t is not None]
        want_y = naive_causal_conv(x, None, w, b)
        got_y = CC.causal_conv_train(x, w, b)
        assert_close(got_y, want_y, atol=1e-5, rtol=1e-5, name="y")
        for name, got, want in zip(("dx", "dw", "db"), torch.autograd.grad(got_y, leaves, gy),
                                   torch.autograd.grad(want_y, leaves, gy)):
            assert_close(got, want, atol=1e-4, rtol=1e-4, name=name)

    def test_a_compiled_training_step_through_the_conv_kernel_matches_reference(monkeypatch):
        """Mamba2Mixer.forward's training branch under torch.compile (the custom op opaque, its
        fake and backward registered) gives the eager reference's loss and gradients."""
        from ssmspec.ops import dispatch

        model = _tiny_model_with_head_dim(("mamba", "mlp", "mamba"), 8).train()
        ids = torch.randint(0, 64, (2, 11))

        def grads(forward):
            model.zero_grad()
            forward(ids).float().logsumexp(-1).mean().backward()
            return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

        want = grads(model)
        calls = []

        def counted(*args):
            calls.append(1)
            return CC.causal_conv_train(*args)

        monkeypatch.setattr(dispatch, "uses_kernel", lambda op, device: op == "causal_conv_train")
        monkeypatch.setattr(dispatch, "resolve", lambda op, device: counted if op == "causal_conv_train"
                            else dispatch._REFERENCE[op])
        torch._dynamo.reset()
        got = grads(torch.compile(model, backend="aot_eager", dynamic=False))
        assert len(calls) == 2  # traced once per Mamba layer
        assert got.keys() == want.keys()
        for name in want:
            assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, name=name)

    @pytest.mark.parametrize("op", ["causal_conv", "chunk_scan_forward"])
    def test_model_forward_through_an_inference_kernel_matches_reference(monkeypatch, op):
        """A prompt fed in pieces of 5, 2 (below K-1) and 1 tokens through Mamba2Mixer.forward's kernel
        branch for the conv or the scan (each piece continuing from the cached states) equals the
        reference path: outputs, conv states and SSM states."""
        from ssmspec.ops import dispatch

        monkeypatch.setattr(CS, "TILE", (16, 16, 4, 1))
        monkeypatch.setattr(CS, "FP32_TILE", (16, 16, 4, 1))
        kernel = {"causal_conv": CC.causal_conv, "chunk_scan_forward": CS.chunk_scan_forward}[op]
        model = _tiny_model_with_head_dim(("mamba", "mlp", "mamba"), 16)
        prompt = torch.randint(0, 64, (2, 8))

        def run():
            cache = model.new_cache(2, 32)
            with torch.no_grad():
                logits = [model(prompt[:, a:b], cache) for a, b in ((0, 5), (5, 7), (7, 8))]
            return logits, cache

        ref_logits, ref_cache = run()
        calls = []
        monkeypatch.setattr(dispatch, "uses_kernel", lambda name, device: name == op)
        monkeypatch.setattr(dispatch, "resolve", lambda name, device: (lambda *a: calls.append(1) or kernel(*a))
                            if name == op else dispatch._REFERENCE[name])
        logits, cache = run()
        assert len(calls) == 6  # two Mamba layers, three pieces
        for i, (mine, theirs) in enumerate(zip(logits, ref_logits)):
            assert_close(mine, theirs, atol=1e-5, rtol=1e-4, name=f"piece {i}")
        for mine, theirs in zip(cache.layers, ref_cache.layers):
            if hasattr(mine, "ssm_state"):  # a later layer's inputs differ by the rounding of the one before
                assert_close(mine.conv_state, theirs.conv_state, atol=1e-5, rtol=1e-4, name="conv_state")
                assert_close(mine.ssm_state, theirs.ssm_state, atol=1e-5, rtol=1e-4, name="ssm_state")

    def test_time_step_matches_reference(nan_outputs):
        dt_raw = torch.randn(3, 5, 7) * 10  # both sides of softplus's linear threshold
        bias = torch.randn(7)
        assert_close(SU.time_step(dt_raw, bias, 0.01, 8.0), naive_time_step(dt_raw, bias, 0.01, 8.0), atol=1e-6, rtol=1e-6)
        # a column slice of a projection (strided rows), as the model passes it
        proj = torch.randn(2, 6, 20) * 5
        assert_close(SU.time_step(proj[..., 13:], bias, 0.0, float("inf")), naive_time_step(proj[..., 13:], bias, 0.0, float("inf")),
                     atol=1e-6, rtol=1e-6)

    @pytest.mark.parametrize("n, k", [(37, 100), pytest.param(300, 64, marks=pytest.mark.slow)])
    def test_gemv_matches_reference(n, k, nan_outputs):
        from ssmspec.ops.gemv.naive import naive_linear

        x, w, b = torch.randn(1, 1, k), torch.randn(n, k), torch.randn(n)
        assert_close(GV.linear(x, w, b), naive_linear(x, w, b), atol=1e-4, rtol=1e-4)
        assert_close(GV.linear(x[0], w, None, config=(4, 32, 1)), naive_linear(x[0], w), atol=1e-4, rtol=1e-4)
        # the swept variants: unrolled K loop, persistent grid (fewer programs than tiles), split-K
        for cfg in (GV.GemvConfig(2, 32, 1, unroll=True), GV.GemvConfig(4, 32, 1, persistent=3),
                    GV.GemvConfig(2, 32, 1, split=3), GV.GemvConfig(1, 16, 1, split=2, persistent=5, unroll=True),
                    GV.GemvConfig(2, 0, 1, preload=True), GV.GemvConfig(1, 0, 1, split=2, preload=True)):
            assert_close(GV.linear(x, w, b, config=cfg), naive_linear(x, w, b), atol=1e-4, rtol=1e-4, name=str(cfg))
        parts = GV.gemv_partials(x, w, b, 3)
        assert parts.shape == (3, 1, 1, n)
        assert_close(parts.sum(0), naive_linear(x, w, b), atol=1e-4, rtol=1e-4, name="partials")


    @pytest.mark.parametrize("m", [2, 5, 17])
    def test_skinny_linear_matches_reference(m, nan_outputs):
        """The tree-verify projection: m rows (not a power of two, one more than a tile) at once."""
        from ssmspec.ops.gemv.naive import naive_linear

        n, k = 70, 150  # neither a multiple of the tile
        x, w, b = torch.randn(1, m, k), torch.randn(n, k), torch.randn(n)
        assert_close(GV.linear(x, w, b), naive_linear(x, w, b), atol=1e-4, rtol=1e-4, name="dispatch")
        assert_close(GV.skinny_linear(x, w, None, config=(16, 32, 1, 1)), naive_linear(x, w), atol=1e-4, rtol=1e-4)


    @pytest.mark.parametrize("m", [3, 17, 40])
    def test_skinny_linear_tma_matches_reference(m, nan_outputs):
        """The skinny GEMM with the weight read through a TMA descriptor, the tile as x W^T (1) or
        as W x^T transposed (2), at awkward sizes: N and K not multiples of the box (the copy
        engine pads the overhang with zeros), rows past a tile."""
        from ssmspec.ops.gemv.naive import naive_linear, naive_norm_linear

        n, k = 70, 152  # a row of 152 fp32 is 16-byte aligned, as TMA needs; 152 = 4 x 32 + 24
        x, w = torch.randn(1, m, k), torch.randn(n, k)
        assert GV._weight_descriptor(w, 16, 32) is not None  # the TMA path really runs
        # (..., 1, 2|3): the first 1 or 2 weight boxes loaded ahead of the rest (before the PDL
        # wait on the GPU); K = 152 leaves a partial box after them
        for cfg in ((16, 32, 1, 1, 0, 1), (32, 64, 1, 1, 0, 1), (16, 32, 1, 1, 0, 2), (64, 32, 1, 1, 0, 2),
                    (16, 32, 1, 1, 0, 1, 2), (32, 64, 1, 1, 0, 1, 3), (64, 32, 1, 1, 0, 2, 2), (64, 32, 1, 1, 0, 2, 3)):
            assert_close(GV.skinny_linear(x, w, None, config=cfg), naive_linear(x, w), atol=1e-4, rtol=1e-4,
                         name=str(cfg))
        # the preloaded boxes with the norm from the producer's sums of squares and the residual add
        xk, wk = torch.randn(1, m, 128), torch.randn(n, 128)
        res = torch.randn(1, m, n)
        want = naive_norm_linear(xk, wk, None, 1, 1e-5, residual=res)
        for cfg in ((64, 32, 1, 1, 0, 2, 3), (16, 32, 1, 1, 0, 1, 3)):
            got = GV.skinny_linear(xk, wk, None, config=cfg, norm_groups=1, eps=1e-5, residual=res,
                                   x_sq=xk.pow(2).sum(-1).reshape(m, 1, 1))
            assert_close(got, want, atol=1e-4, rtol=1e-4, name=f"norm {cfg}")
        assert GV._weight_descriptor(torch.randn(n, 150), 16, 32) is None  # unaligned rows: pointer loads
        with pytest.raises(ValueError, match="balanced"):
            GV.skinny_linear(x, w, None, config=(0, 32, 1, 1, 2, 1))


    def test_wide_skinny_route_takes_norm_parts_and_residual(nan_outputs, monkeypatch):
        """From 17 to SKINNY_WIDE_MAX_ROWS rows a shape listed in SKINNY_WIDE runs the skinny GEMM
        (norm from the producer's parts, residual in the epilogue, its own parts out) instead of
        the norm kernel and cuBLAS; unlisted shapes and more rows keep cuBLAS."""
        from ssmspec.ops.gemv.naive import naive_norm_linear

        n, k = 70, 128
        import types

        monkeypatch.setattr(GV, "SKINNY_WIDE", types.MappingProxyType({**GV.SKINNY_WIDE, (n, k): (16, 32, 1, 1, 0, 2)}))
        assert GV.skinny_rows(40, n, k) and not GV.skinny_rows(40, n, 150) and not GV.skinny_rows(65, n, k)
        x, w, res = torch.randn(1, 40, k) * 3, torch.randn(n, k) / 8, torch.randn(1, 40, n)
        x_sq = x.pow(2).sum(-1).reshape(40, 1, 1) * torch.tensor([0.25, 0.75]).reshape(1, 1, 2)
        want, want_sq = naive_norm_linear(x, w, None, 1, 1e-5, res, return_sq=True)
        spent = res.clone()
        got, got_sq = GV.norm_linear(x, w, None, 1, 1e-5, spent, x_sq=x_sq, return_sq=True, reuse_residual=True)
        assert got.data_ptr() != spent.data_ptr() and got_sq is not None  # the skinny route, not cuBLAS
        assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert_close(got_sq.sum(-1, keepdim=True), want_sq, atol=1e-3, rtol=1e-5, name="sq")
        wrong = GV.norm_linear(x, w, None, 1, 1e-5, x_sq=x_sq * 4)  # the parts are what it uses
        assert_close(wrong, naive_norm_linear(x, w, None, 1, 1e-5) / 2, atol=1e-4, rtol=1e-4, name="x4")
        assert_close(GV.linear(x, w), torch.nn.functional.linear(x, w), atol=1e-4, rtol=1e-4, name="linear")


    def test_add_rms_norm_matches_reference(nan_outputs):
        from ssmspec.ops.step_update.naive import naive_add_rms_norm

        h, d, w = torch.randn(2, 1, 300), torch.randn(2, 1, 300), torch.randn(300)
        for got, want in zip(SU.add_rms_norm(d, h, w, 1e-5), naive_add_rms_norm(d, h, w, 1e-5)):
            assert_close(got, want, atol=1e-5, rtol=1e-5)
        parts = torch.randn(3, 2, 1, 300)  # split-K partial sums of the sublayer output
        for got, want in zip(SU.add_rms_norm(parts, h, w, 1e-5), naive_add_rms_norm(parts, h, w, 1e-5)):
            assert_close(got, want, atol=1e-5, rtol=1e-5, name="partials")


    @pytest.mark.parametrize("rows", [1, 3, 20], ids=["gemv", "skinny", "norm-then-cublas"])
    @pytest.mark.parametrize("norm_groups", [0, 1, 3])
    def test_norm_linear_matches_reference(rows, norm_groups, nan_outputs):
        """A projection with the weightless RMSNorm before it and the residual add after it (the
        norms folded into the weights: models/fold.py), every route and GEMV variant."""
        from ssmspec.ops.gemv.naive import naive_norm_linear

        n, k = 70, 150  # neither a multiple of a tile; 150 = 3 groups of 50
        x, w, b = torch.randn(1, rows, k) * 3, torch.randn(n, k) / 8, torch.randn(n)
        res = torch.randn(1, rows, n)
        for bias, residual in ((b, None), (None, res), (b, res)):
            want = naive_norm_linear(x, w, bias, norm_groups, 1e-5, residual)
            got = GV.norm_linear(x, w, bias, norm_groups, 1e-5, residual)
            assert_close(got, want, atol=1e-4, rtol=1e-4, name=f"bias {bias is not None}, residual {residual is not None}")
        spent = res.clone()  # given up by the caller: the cuBLAS route adds into it in place
        got = GV.norm_linear(x, w, None, norm_groups, 1e-5, spent, reuse_residual=True)
        assert_close(got, naive_norm_linear(x, w, None, norm_groups, 1e-5, res), atol=1e-4, rtol=1e-4, name="reuse")
        assert (got.data_ptr() == spent.data_ptr()) == (rows > GV.SKINNY_MAX_ROWS)
        if rows == 1:
            for cfg in (GV.GemvConfig(1, 0, 1, preload=True), GV.GemvConfig(2, 32, 1, unroll=True),
                        GV.GemvConfig(4, 64, 1, persistent=3)):
                assert_close(GV.norm_linear(x, w, b, norm_groups, 1e-5, res, config=cfg),
                             naive_norm_linear(x, w, b, norm_groups, 1e-5, res), atol=1e-4, rtol=1e-4, name=str(cfg))


    @pytest.mark.parametrize("norm_groups", [1, 4])
    def test_norm_linear_scales_dot_products(norm_groups, nan_outputs):
        """The preloaded one-row GEMV applies the norm as scales of its dot products (one group:
        the sum of squares inside the dot's reduction; power-of-two groups over a power-of-two K:
        per-group dots): the same result as normalising first, within fp32 rounding."""
        from ssmspec.ops.gemv.naive import naive_norm_linear

        n, k = 37, 128
        x, w, res = torch.randn(1, 1, k) * 3, torch.randn(n, k) / 8, torch.randn(1, 1, n)
        assert GV.grouped_epilogue(k, k, norm_groups) == (norm_groups > 1)
        for block_n in (1, 2):
            cfg = GV.GemvConfig(block_n, 0, 1, preload=True)
            assert_close(GV.norm_linear(x, w, None, norm_groups, 1e-5, res, config=cfg),
                         naive_norm_linear(x, w, None, norm_groups, 1e-5, res), atol=1e-4, rtol=1e-4, name=str(cfg))
        # the skinny GEMM (norm kernel first, residual in its epilogue), 5 rows
        x5, res5 = torch.randn(1, 5, k) * 3, torch.randn(1, 5, n)
        for cfg in ((16, 32, 1, 1), (32, 128, 1, 1)):
            assert_close(GV.skinny_linear(x5, w, None, cfg, res5, norm_groups, 1e-5),
                         naive_norm_linear(x5, w, None, norm_groups, 1e-5, res5), atol=1e-4, rtol=1e-4, name=str(cfg))


    @pytest.mark.parametrize("activation", ["relu", "relu2", "silu", "gelu"])
    def test_norm_linear_activation_in_the_epilogue(activation, nan_outputs):
        """The MLP's up projection with its activation: inside the skinny GEMM's epilogue (relu,
        relu2, silu), after it otherwise (gelu; one row), as the reference applies it."""
        from ssmspec.ops.gemv.naive import naive_norm_linear

        n, k = 70, 128
        w = torch.randn(n, k) / 8
        for rows in (1, 5):
            x = torch.randn(1, rows, k) * 3
            want = naive_norm_linear(x, w, None, 1, 1e-5, activation=activation)
            got = GV.norm_linear(x, w, None, 1, 1e-5, activation=activation)
            assert_close(got, want, atol=1e-4, rtol=1e-4, name=f"{activation} rows {rows}")
            assert (want < 0).any() == (activation in ("silu", "gelu"))  # the activation was applied
        with pytest.raises(ValueError, match="residual"):
            GV.norm_linear(x, w, None, 1, 1e-5, torch.randn(1, 5, n), activation=activation)


    @pytest.mark.parametrize("norm_groups", [1, 2])
    def test_norm_linear_from_partial_sums_of_squares(norm_groups, nan_outputs):
        """The skinny GEMM takes the norm from its input's partial sums of squares (x_sq, as the
        producer kernel writes them: no norm launch) and writes its output's (return_sq): the
        reference's results, and parts that add up to the output rows' sums of squares."""
        import triton

        from ssmspec.ops.gemv.naive import naive_norm_linear

        n, k, rows = 70, 128, 5
        x, w, res = torch.randn(1, rows, k) * 3, torch.randn(n, k) / 8, torch.randn(1, rows, n)
        sums = x.reshape(rows, norm_groups, -1).pow(2).sum(-1)  # (rows, groups)
        split = torch.rand(rows, norm_groups, 3) + 0.1
        x_sq = sums[..., None] * split / split.sum(-1, keepdim=True)  # three uneven parts per group
        want, want_sq = naive_norm_linear(x, w, None, norm_groups, 1e-5, res, return_sq=True)
        # 128 > a group of 64 at two groups: the block shrinks; (0, ..., k): the balanced grid,
        # k programs per SM (4 "SMs" under the interpreter), 70 columns as 8 and 9 per program
        # (..., 0, 1|2): TMA weight loads (two groups: a box per group's K range)
        for cfg in ((16, 32, 1, 1), (32, 128, 1, 1), (0, 32, 1, 1, 2), (16, 32, 1, 1, 0, 1), (32, 64, 1, 1, 0, 2),
                    (16, 32, 1, 1, 0, 1, 3)):
            got, got_sq = GV.skinny_linear(x, w, None, cfg, res, norm_groups, 1e-5, x_sq=x_sq, return_sq=True)
            assert_close(got, want, atol=1e-4, rtol=1e-4, name=str(cfg))
            assert got_sq.shape == (rows, 1, 8 if len(cfg) == 5 else triton.cdiv(n, cfg[0]))
            assert_close(got_sq.sum(-1, keepdim=True), want_sq, atol=1e-3, rtol=1e-5, name=f"sq {cfg}")
        got, got_sq = GV.norm_linear(x, w, None, norm_groups, 1e-5, res, x_sq=x_sq, return_sq=True)
        assert_close(got, want, atol=1e-4, rtol=1e-4, name="norm_linear")
        # the parts are what the norm uses: four times the sums halve every scale
        wrong = GV.skinny_linear(x, w, None, None, None, norm_groups, 1e-5, x_sq=x_sq * 4)
        assert_close(wrong, naive_norm_linear(x, w, None, norm_groups, 1e-5) / 2, atol=1e-4, rtol=1e-4, name="x4")
        with pytest.raises(ValueError, match="x_sq"):
            GV.skinny_linear(x, w, None, None, None, norm_groups, 1e-5, x_sq=x_sq[:, :, 0])


    @pytest.mark.parametrize("shape", [(1, 4, 16, 16, 1, 1, 4), (1, 6, 16, 8, 2, 3, 3), (1, 3, 8, 16, 1, 1, 4),
                                       (2, 4, 16, 16, 2, 2, 4)],
                             ids=["G1", "G2-norm3-K3", "P8", "fallback-batch2"])
    @pytest.mark.parametrize("preload", [False, True], ids=["looped", "preloaded"])
    def test_mamba_step_out_matches_reference(shape, preload, nan_outputs, monkeypatch):
        """The step with the gated norm (weight folded into out_proj) and the residual add inside
        the out_proj GEMV (batch 1), and the fallback (batch 2, or a norm weight). preloaded: the
        GEMV config the H100 runs (one row, all of K loaded at once)."""
        from ssmspec.ops.step_update.naive import naive_mamba_step_out

        if preload:
            monkeypatch.setattr(GV, "gemv_config", lambda n, k, device: GV.GemvConfig(1, 0, 1, preload=True))

        batch, heads, head_dim, d_state, groups, norm_groups, kernel_size = shape
        channels, d_inner, d_model = heads * head_dim + 2 * groups * d_state, heads * head_dim, 40
        xbc = torch.randn(batch, channels)
        dt_raw = torch.randn(batch, heads)
        z = torch.randn(batch, d_inner)
        conv_state = torch.randn(batch, channels, kernel_size - 1)
        ssm_state = torch.randn(batch, heads, head_dim, d_state)
        residual = torch.randn(batch, d_model)
        for norm_weight, res in ((None, residual), (None, None), (torch.randn(d_inner), residual)):
            args = (torch.randn(channels, kernel_size), torch.randn(channels), torch.randn(heads), torch.randn(heads),
                    torch.randn(heads), norm_weight, groups, norm_groups, 0.01, 5.0, 1e-5,
                    torch.randn(d_model, d_inner) / 8, torch.randn(d_model))
            cs_want, ss_want = conv_state.clone(), ssm_state.clone()
            cs_got, ss_got = conv_state.clone(), ssm_state.clone()
            want = naive_mamba_step_out(xbc, dt_raw, z, cs_want, ss_want, *args, residual=res)
            got = SU.mamba_step_out(xbc, dt_raw, z, cs_got, ss_got, *args, residual=res)
            label = f"norm weight {norm_weight is not None}, residual {res is not None}"
            assert got.shape == (batch, d_model)
            assert_close(got, want, atol=1e-4, rtol=1e-4, name=label)
            assert_close(ss_got, ss_want, atol=1e-5, rtol=1e-5, name="ssm_state")
            assert torch.equal(cs_got, cs_want), f"conv state shift differs ({label})"

