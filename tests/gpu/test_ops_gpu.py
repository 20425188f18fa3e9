"""Triton kernels and the CUDA-graph decode path on a real GPU, at mamba2-2.7b layer sizes (opt in: --run-gpu)."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import assert_close, tiny_model
from ssmspec.trees import Tree

pytestmark = pytest.mark.requires_cuda
DEV = "cuda"
H, P, S, K = 80, 64, 128, 4
TREES = {"one": Tree.from_parents([-1]), "chain63": Tree.chain(63), "binary31": Tree.from_config((2, 2, 2, 2)),
         "wide40": Tree.from_config((40,)), "3421": Tree.from_config((3, 4, 2, 1)),
         "three-of-3-40": Tree.from_config((3, 3, 3))}


def _poison(nbytes):
    """Free a NaN block so that the kernel's next allocation likely reuses it (unwritten lanes -> NaN)."""
    del_me = torch.full((nbytes // 4 + 1024,), float("nan"), device=DEV)
    del del_me


def _tiny_model_with_head_dim(layers, head_dim):
    """helpers.tiny_model with another Mamba head size (16 takes the folded out_proj path)."""
    import dataclasses

    from helpers import tiny_config
    from ssmspec.models import LanguageModel, MambaConfig
    from ssmspec.models.init import init_weights

    cfg = dataclasses.replace(tiny_config(layers), mamba=MambaConfig(n_heads=4, head_dim=head_dim, d_state=8, n_groups=2,
                                                                     chunk_size=8))
    return init_weights(LanguageModel(cfg), seed=0, std=0.2).eval()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("tree_name", list(TREES))
@pytest.mark.parametrize("groups", [1, 8])
def test_tree_scan_gpu(tree_name, groups):
    from ssmspec.ops.tree_scan.naive import naive_tree_scan
    from ssmspec.ops.tree_scan.triton import tree_scan

    tree = TREES[tree_name]
    n = tree.num_nodes
    x = torch.randn(2, n, H, P, device=DEV, dtype=torch.bfloat16)
    dt = torch.rand(2, n, H, device=DEV) * 0.1
    A = -(1 + torch.rand(H, device=DEV) * 15)
    B = torch.randn(2, n, groups, S, device=DEV, dtype=torch.bfloat16) * 0.3
    C = torch.randn(2, n, groups, S, device=DEV, dtype=torch.bfloat16) * 0.3
    D = torch.randn(H, device=DEV)
    h0 = torch.randn(2, H, P, S, device=DEV)
    parents = tree.parents_tensor(DEV)
    want = naive_tree_scan(x, dt, A, B, C, D, parents, h0)
    _poison(want.numel() * 4)
    assert_close(tree_scan(x, dt, A, B, C, D, parents, h0, precision="ieee"), want, atol=1e-4, rtol=1e-4, name="ieee")
    _poison(want.numel() * 4)
    got = tree_scan(x, dt, A, B, C, D, parents, h0, precision="tf32")
    assert torch.isfinite(got).all() and _rel(got, want) < 3e-3


@pytest.mark.parametrize("tree_name", list(TREES))
def test_tree_conv_and_replay_gpu(tree_name):
    from ssmspec.ops.state_replay.naive import naive_replay_conv_state, naive_replay_ssm_state
    from ssmspec.ops.state_replay.triton import replay_conv_state, replay_ssm_state
    from ssmspec.ops.tree_conv.naive import naive_tree_conv
    from ssmspec.ops.tree_conv.triton import tree_conv

    tree = TREES[tree_name]
    n, channels = tree.num_nodes, H * P + 2 * S
    parents = tree.parents_tensor(DEV)
    xbc = torch.randn(2, n, channels, device=DEV, dtype=torch.bfloat16)
    cs = torch.randn(2, channels, K - 1, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(channels, K, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(channels, device=DEV, dtype=torch.bfloat16)
    want = naive_tree_conv(xbc, cs, w, bias, parents)
    _poison(want.numel() * 2)
    got = tree_conv(xbc, cs, w, bias, parents)
    assert torch.isfinite(got).all() and _rel(got, want) < 4e-3  # bf16 output: rounding-level
    deepest = max(range(n), key=lambda i: len(tree.path(i)))
    path = torch.tensor([tree.path(deepest)] * 2, device=DEV)
    path_len = torch.tensor([path.shape[1], max(1, path.shape[1] // 2)], device=DEV)
    x = torch.randn(2, n, H, P, device=DEV, dtype=torch.bfloat16)
    dt = torch.rand(2, n, H, device=DEV) * 0.1
    A = -(1 + torch.rand(H, device=DEV) * 15)
    B = torch.randn(2, n, 1, S, device=DEV, dtype=torch.bfloat16)
    h0 = torch.randn(2, H, P, S, device=DEV)
    s_want, s_got = h0.clone(), h0.clone()
    naive_replay_ssm_state(s_want, x, dt, A, B, path, path_len)
    replay_ssm_state(s_got, x, dt, A, B, path, path_len)
    assert_close(s_got, s_want, atol=1e-5, rtol=1e-5)
    c_want, c_got = cs.clone(), cs.clone()
    naive_replay_conv_state(c_want, xbc, path, path_len)
    replay_conv_state(c_got, xbc, path, path_len)
    assert torch.equal(c_got, c_want)


@pytest.mark.parametrize("batch", [1, 3])
def test_mamba_step_gpu(batch):
    from ssmspec.ops.step_update.naive import naive_mamba_step
    from ssmspec.ops.step_update.triton import mamba_step

    channels = H * P + 2 * S
    xbc = torch.randn(batch, channels, device=DEV, dtype=torch.bfloat16)
    dt_raw = torch.randn(batch, H, device=DEV, dtype=torch.bfloat16)
    z = torch.randn(batch, H * P, device=DEV, dtype=torch.bfloat16)
    cs = torch.randn(batch, channels, K - 1, device=DEV, dtype=torch.bfloat16)
    ss = torch.randn(batch, H, P, S, device=DEV)
    args = (torch.randn(channels, K, device=DEV, dtype=torch.bfloat16), torch.randn(channels, device=DEV, dtype=torch.bfloat16),
            torch.randn(H, device=DEV), torch.randn(H, device=DEV), torch.randn(H, device=DEV),
            torch.randn(H * P, device=DEV, dtype=torch.bfloat16), 1, 1, 0.0, math.inf, 1e-5)
    cs2, ss2 = cs.clone(), ss.clone()
    want = naive_mamba_step(xbc, dt_raw, z, cs, ss, *args)
    got = mamba_step(xbc, dt_raw, z, cs2, ss2, *args)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2
    assert_close(ss2, ss, atol=1e-5, rtol=1e-5)
    assert torch.equal(cs2, cs)


@pytest.mark.parametrize("pending", [0, 8], ids=["plain-cache", "pending-slots"])
@pytest.mark.parametrize("variant", ["tiny", "tiny-folded", "P16-hybrid-folded", "tiny-folded-split"])
def test_greedy_fast_path_equals_reference_token_for_token(variant, pending, monkeypatch):
    """fp32 tiny model: the CUDA-graph step and the greedy tree graph (Triton) reproduce the
    reference path's greedy tokens exactly. folded: norm weights folded into the projections
    (models/fold.py), so the norms and residual adds run inside the projections. pending: the
    tree iterations keep their inputs in pending slots (models/cache.py), and the step graph
    that continues after them flushes them first. split: the verify layers split in_proj, z's
    GEMM on a second stream (ops/overlap.py), at any row count."""
    from ssmspec.decoding.graphs import GreedyTreeGraph, StepGraph
    from ssmspec.ops import dispatch, paths

    if variant.startswith("tiny"):
        model = tiny_model().to(DEV)
    else:
        model = _tiny_model_with_head_dim(("mamba", "mlp", "attention", "mamba"), 16).to(DEV)
    if "folded" in variant:
        model.fold_norm_weights_()
    if variant.endswith("split"):
        monkeypatch.setattr(paths, "SPLIT_IN_PROJ_MIN_ROWS", 2)
    prompt = torch.randint(0, 64, (1, 7), device=DEV)

    def reference_greedy(steps):
        dispatch.set_backend("reference")
        try:
            cache = model.new_cache(1, 64)
            with torch.no_grad():
                tok = model(prompt, cache, last_only=True).argmax(-1)
                out = [int(tok)]
                for _ in range(steps - 1):
                    tok = model.step(tok, cache).argmax(-1)
                    out.append(int(tok))
            return out
        finally:
            dispatch.set_backend("auto")

    want = reference_greedy(32)
    dispatch.set_backend("triton")
    try:
        cache = model.new_cache(1, 64)
        with torch.no_grad():
            tok = model(prompt, cache, last_only=True).argmax(-1)
        graph = StepGraph(model, cache)
        got = [int(tok)]
        for _ in range(23):
            tok = graph(tok).argmax(-1)
            got.append(int(tok))
        assert got == want[:24]
        # tree iterations: drafts whose first-child path is the greedy continuation
        tree = Tree.from_config((2, 2, 1))
        cache = model.new_cache(1, 64, pending=pending)
        with torch.no_grad():
            model(prompt, cache, last_only=True)
        g = GreedyTreeGraph(model, cache, tree)
        produced = [want[0]]
        first_path = tree.path(max(range(tree.num_nodes), key=lambda i: (tree.depths[i], -i)))
        while len(produced) < 20:
            tokens = torch.randint(0, 64, (1, tree.num_nodes), device=DEV)
            tokens[0, 0] = produced[-1]
            for d, node in enumerate(first_path[1:]):
                tokens[0, node] = want[len(produced) + d] if len(produced) + d < len(want) else 0
            out, n = g(tokens)
            produced += out[0, : int(n[0])].tolist()
        assert produced[:20] == want[:20]
        if pending:
            assert cache.pending_dirty
        graph = StepGraph(model, cache)  # steps after the tree iterations, on the same cache
        tok = torch.tensor([[produced[-1]]], device=DEV)
        while len(produced) < 30:
            tok = graph(tok).argmax(-1)
            produced.append(int(tok))
        assert produced[:30] == want[:30]
    finally:
        dispatch.set_backend("auto")


@pytest.mark.parametrize("n, k", [(2 * H * P + 2 * S + H, 2560), (2560, H * P)], ids=["in_proj", "out_proj"])
def test_gemv_variants_gpu(n, k):
    """Every GEMV variant of the sweep (unrolled, persistent, split-K) at the projection shapes."""
    from ssmspec.ops.gemv.triton import GemvConfig, gemv_partials, linear

    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(1, 1, k, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x.double(), w.double(), b.double())
    for cfg in (None, GemvConfig(2, 1024, 4, unroll=True), GemvConfig(1, 1024, 4, persistent=528),
                GemvConfig(2, 512, 4, persistent=2112, unroll=True),
                GemvConfig(1, 0, 8, preload=True), GemvConfig(2, 0, 8, split=2, preload=True)):
        _poison(n * 4)
        got = linear(x, w, b, config=cfg)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all() and _rel(got, want) < 5e-3, cfg
    for split in (2, 4):
        _poison(n * 4 * split)
        parts = gemv_partials(x, w, b, split)
        assert parts.shape == (split, 1, 1, n) and _rel(parts.sum(0), want) < 1e-4


@pytest.mark.parametrize("m", [2, 16, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_skinny_linear_gpu(m, dtype):
    from ssmspec.ops.gemv.triton import linear

    for n, k in ((2 * H * P + 2 * S + H, 2560), (2560, H * P), (50288, 2560)):  # in_proj, out_proj, LM head
        w = torch.randn(n, k, device=DEV, dtype=dtype)
        x = torch.randn(1, m, k, device=DEV, dtype=dtype)
        b = torch.randn(n, device=DEV, dtype=dtype)
        want = torch.nn.functional.linear(x.double(), w.double(), b.double())
        _poison(m * n * 4)
        got = linear(x, w, b)
        assert got.shape == (1, m, n) and torch.isfinite(got).all()
        assert _rel(got, want) < (5e-3 if dtype == torch.bfloat16 else 1e-5)


def test_add_rms_norm_gpu():
    from ssmspec.ops.step_update.naive import naive_add_rms_norm
    from ssmspec.ops.step_update.triton import add_rms_norm

    for dim in (2560, 4096):
        h = torch.randn(3, 1, dim, device=DEV, dtype=torch.bfloat16)
        d = torch.randn(3, 1, dim, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(dim, device=DEV, dtype=torch.bfloat16)
        got, want = add_rms_norm(d, h, w, 1e-5), naive_add_rms_norm(d, h, w, 1e-5)
        assert torch.equal(got[0], want[0])  # the residual sum rounds exactly as torch's add
        assert _rel(got[1], want[1]) < 1e-2
        parts = torch.randn(4, 3, 1, dim, device=DEV)
        got, want = add_rms_norm(parts, h, w, 1e-5), naive_add_rms_norm(parts, h, w, 1e-5)
        assert _rel(got[0], want[0]) < 1e-2 and _rel(got[1], want[1]) < 1e-2



@pytest.mark.parametrize("heads, groups, norm_groups", [(80, 1, 1), (128, 8, 8)], ids=["2.7b", "8b"])
def test_mamba_step_out_gpu(heads, groups, norm_groups):
    """The gated norm (weight folded into out_proj) and the residual add inside the out_proj GEMV
    at the mamba2-2.7b and hybrid-8b mixer shapes (batch 1)."""
    from ssmspec.ops.step_update.naive import naive_mamba_step_out
    from ssmspec.ops.step_update.triton import mamba_step_out

    d_inner, channels = heads * P, heads * P + 2 * groups * S
    d_model = d_inner // 2
    bf = torch.bfloat16
    xbc = torch.randn(1, channels, device=DEV, dtype=bf)
    dt_raw = torch.randn(1, heads, device=DEV, dtype=bf)
    z = torch.randn(1, d_inner, device=DEV, dtype=bf)
    cs = torch.randn(1, channels, K - 1, device=DEV, dtype=bf)
    ss = torch.randn(1, heads, P, S, device=DEV)
    residual = torch.randn(1, d_model, device=DEV, dtype=bf)
    args = (torch.randn(channels, K, device=DEV, dtype=bf), torch.randn(channels, device=DEV, dtype=bf),
            torch.randn(heads, device=DEV), torch.randn(heads, device=DEV), torch.randn(heads, device=DEV),
            None, groups, norm_groups, 0.0, math.inf, 1e-5,
            torch.randn(d_model, d_inner, device=DEV, dtype=bf) / 64, None)
    cs2, ss2 = cs.clone(), ss.clone()
    want = naive_mamba_step_out(xbc, dt_raw, z, cs, ss, *args, residual=residual)
    _poison(d_model * 4)
    got = mamba_step_out(xbc, dt_raw, z, cs2, ss2, *args, residual=residual)
    assert torch.isfinite(got).all() and _rel(got - residual, want - residual) < 1e-2
    assert_close(ss2, ss, atol=1e-5, rtol=1e-5)
    assert torch.equal(cs2, cs)


@pytest.mark.parametrize("rows", [1, 16, 64])
@pytest.mark.parametrize("n, k, norm_groups", [(10576, 2560, 1), (2560, 5120, 1), (4096, 8192, 8)],
                         ids=["in_proj", "out_proj", "out_proj-8b"])
def test_norm_linear_gpu(rows, n, k, norm_groups):
    """Projections with the folded RMSNorm before them and the residual add after them, bf16, at
    the decode (1 row), 16-node and 64-node verify sizes: GEMV, skinny GEMM, norm + cuBLAS."""
    from ssmspec.ops.gemv.naive import naive_norm_linear
    from ssmspec.ops.gemv.triton import norm_linear, skinny_rows

    bf = torch.bfloat16
    x = torch.randn(1, rows, k, device=DEV, dtype=bf) * 3
    w = torch.randn(n, k, device=DEV, dtype=bf) / math.sqrt(k)
    res = torch.randn(1, rows, n, device=DEV, dtype=bf)
    want = naive_norm_linear(x.float(), w.float(), None, norm_groups, 1e-5, res.float())
    _poison(rows * n * 4)
    got = norm_linear(x, w, None, norm_groups, 1e-5, res)
    assert got.dtype == bf and torch.isfinite(got).all()
    assert _rel(got - res, want - res) < 1e-2
    got = norm_linear(x, w, None, norm_groups, 1e-5)
    assert _rel(got, want - res) < 1e-2
    if skinny_rows(rows, n, k):  # the skinny GEMM with the norm from its producer's partial sums of squares
        sums = x.float().reshape(rows, norm_groups, -1).pow(2).sum(-1)
        x_sq = torch.stack([sums * 0.25, sums * 0.75], dim=-1)  # two parts per group
        got, got_sq = norm_linear(x, w, None, norm_groups, 1e-5, res, x_sq=x_sq, return_sq=True)
        assert _rel(got - res, want - res) < 1e-2
        assert _rel(got_sq.sum(-1).flatten(), got.float().pow(2).sum(-1).flatten()) < 1e-4



@pytest.mark.parametrize("vocab", [8192, 50288, 131072])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ranked_tokens_gpu(vocab, dtype):
    """The drafter's child picks at real vocabularies, ties included, against the reference."""
    from ssmspec.ops.ranked_tokens.naive import naive_ranked_tokens
    from ssmspec.ops.ranked_tokens.triton import ranked_tokens

    x = torch.randn(6, vocab, device=DEV).to(dtype)
    x[:, vocab // 2] = x[:, 7] = (x.float().max(-1).values + 1).to(dtype)  # a tie above everything else
    rows = torch.tensor([0, 0, 0, 1, 2, 3, 4, 5, 5], device=DEV)
    ranks = torch.tensor([0, 1, 2, 0, 3, 7, 0, 1, 15], device=DEV)
    got = ranked_tokens(x, rows, ranks)
    assert torch.equal(got, naive_ranked_tokens(x, rows, ranks))
    assert (got[rows == 0][:2] == torch.tensor([7, vocab // 2], device=DEV)).all()


@pytest.mark.parametrize("vocab", [8192, 131072])
@pytest.mark.parametrize("spec", [(1, 1, 1, 1, 1), (3, 2, 1)])
def test_sampled_accept_gpu(vocab, spec):
    """Multi-step speculative sampling at real vocabularies: the kernel's path and bonus are the
    reference's from the same uniforms and noise (a rejection's residual sum may round apart:
    allow one row in a hundred to differ)."""
    from ssmspec.decoding.acceptance import children_table
    from ssmspec.ops.sampled_accept.naive import naive_sampled_accept
    from ssmspec.ops.sampled_accept.triton import sampled_accept
    from ssmspec.trees import Tree

    tree = Tree.from_config(spec)
    batch, n = 64, tree.num_nodes
    g = torch.Generator(device=DEV).manual_seed(vocab)
    # peaked distributions over a few hundred tokens, so acceptances and rejections both occur
    logits = torch.randn(batch, n, vocab, device=DEV, generator=g) * 6
    p = torch.softmax(logits, -1)  # q close to p: drafts are often accepted, sometimes not
    q = torch.softmax(logits + torch.randn(batch, n, vocab, device=DEV, generator=g) * 2, -1)
    tokens = torch.zeros(batch, n, dtype=torch.long, device=DEV)
    for u in range(1, n):
        tokens[:, u] = torch.multinomial(q[:, tree.parents[u]], 1, generator=g)[:, 0]
    children = children_table(tree, DEV)
    uniforms = torch.rand(batch, n, children.shape[1], device=DEV, generator=g)
    noise = torch.empty(batch, n, vocab, device=DEV).exponential_(generator=g)
    paths = torch.zeros(n, tree.max_depth + 1, dtype=torch.long)
    for i in range(n):
        paths[i, :len(tree.path(i))] = torch.tensor(tree.path(i))
    args = (p, q, tokens, children, uniforms, noise, paths.to(DEV), tree.depth_tensor(DEV))
    want, got = naive_sampled_accept(*args), sampled_accept(*args)
    same = (got[2] == want[2]).all(-1) & (got[1] == want[1])
    assert int(same.sum()) >= batch - 1
    assert len(set(want[1].tolist())) > 1


@pytest.mark.parametrize("vocab", [8192, 131072])
def test_race_tokens_gpu(vocab):
    """The drafter's raced children at real vocabularies against the reference."""
    from ssmspec.ops.ranked_tokens.naive import naive_race_tokens
    from ssmspec.ops.ranked_tokens.triton import race_tokens

    probs = torch.softmax(torch.randn(5, vocab, device=DEV) * 3, -1)
    rows = torch.tensor([0, 0, 1, 2, 4, 4, 4], device=DEV)
    noise = torch.empty(7, vocab, device=DEV).exponential_()
    assert torch.equal(race_tokens(probs, rows, noise), naive_race_tokens(probs, rows, noise))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, T, channels, state", [(32, 512, 1792, False), (8, 2048, 5376, False), (2, 300, 1792, True)])
def test_causal_conv_gpu(batch, T, channels, state, dtype):
    """The sequence conv + silu kernel at the mamba2-130m distillation target's shape, the 2.7b's,
    and a prefill with a conv state; xBC a slice of in_proj's output as the mixer passes it."""
    from ssmspec.ops.causal_conv.naive import naive_causal_conv
    from ssmspec.ops.causal_conv.triton import causal_conv

    g = torch.Generator(device=DEV).manual_seed(T)
    proj = torch.randn(batch, T, channels + 300, device=DEV, generator=g).to(dtype)
    xBC = proj[..., 200 : 200 + channels]
    weight, bias = torch.randn(channels, K, device=DEV, generator=g), torch.randn(channels, device=DEV, generator=g)
    conv_state = torch.randn(batch, channels, K - 1, device=DEV, generator=g) if state else None
    _poison(batch * T * channels * 4)
    got, want = causal_conv(xBC, conv_state, weight, bias), naive_causal_conv(xBC, conv_state, weight, bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: one rounding on each side, maybe a different one
    assert got.dtype == dtype and got.is_contiguous()
    assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, T, channels", [(16, 512, 1792), (8, 512, 4352), (3, 300, 200)])
def test_causal_conv_train_gpu(batch, T, channels, dtype):
    """The training conv both ways at the 130m and 1.3b training shapes (xBC a slice of in_proj's
    output), against autograd through naive_causal_conv with fp32 taps, as under autocast."""
    from ssmspec.ops.causal_conv.naive import naive_causal_conv
    from ssmspec.ops.causal_conv.triton import causal_conv_train

    g = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(batch, T, channels + 300, device=DEV, generator=g).to(dtype)[..., 200 : 200 + channels]
    x.requires_grad_()
    w = (0.5 * torch.randn(channels, K, device=DEV, generator=g)).requires_grad_()
    b = (0.3 * torch.randn(channels, device=DEV, generator=g)).requires_grad_()
    gy = torch.randn(batch, T, channels, device=DEV, generator=g).to(dtype)
    got_y, want_y = causal_conv_train(x, w, b), naive_causal_conv(x, None, w, b)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close(got_y.float(), want_y.float(), atol=tol, rtol=tol, name="y")
    for name, got, want in zip(("dx", "dw", "db"), torch.autograd.grad(got_y, (x, w, b), gy),
                               torch.autograd.grad(want_y, (x, w, b), gy)):
        scale = want.float().abs().max().item()  # dw, db sum over batch x T terms: tolerance by their size
        assert_close(got.float(), want.float(), atol=(1e-5 if dtype == torch.float32 else 2e-2) * scale, rtol=tol, name=name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, vocab, pad, kl, ce, temperature", [
    (8192, 8192, 0, 0.0, 1.0, 1.0), (16384, 8192, 0, 1.0, 0.0, 1.0), (4096, 8192, 0, 1.0, 0.5, 2.0),
    (1000, 50277, 27, 1.0, 0.5, 1.0), (513, 131072, 0, 0.0, 1.0, 1.0)])
def test_token_losses_gpu(rows, vocab, pad, kl, ce, temperature, dtype):
    """The fused token losses at sft 130m's CE (16 x 512 positions, vocabulary 8192), distillation's
    KL (32 x 512) and KL + CE at another temperature, and at the GPT-NeoX (rows padded as Inductor
    pads them) and Nemotron vocabularies, against the reference (both fp32 inside: the bf16
    gradient may differ in its last bit)."""
    from ssmspec.ops.token_loss.naive import naive_token_losses
    from ssmspec.ops.token_loss.triton import token_losses

    g = torch.Generator(device=DEV).manual_seed(rows)
    student = (4 * torch.randn(rows, vocab + pad, device=DEV, generator=g)).to(dtype)[:, :vocab]
    target = (4 * torch.randn(rows, vocab + pad, device=DEV, generator=g)).to(dtype)[:, :vocab]
    labels = torch.randint(0, vocab, (rows,), device=DEV, generator=g)
    mask = torch.rand(rows, device=DEV, generator=g) > 0.2
    scale = 1.0 / mask.sum().float()
    args = (student, target, labels, mask, scale, kl, ce, temperature)
    _poison(rows * vocab * 4)
    got, want = token_losses(*args), naive_token_losses(*args)
    assert_close(got[0], want[0], atol=1e-4, rtol=1e-5, name="kl rows")
    assert_close(got[1], want[1], atol=1e-4, rtol=1e-5, name="ce rows")
    # one bf16 ulp (2^-7 relative at most): the two fp32 results differ in their last bits and can round either way
    ulp = 1e-5 if dtype == torch.float32 else 2 ** -7
    assert_close(got[2].float(), want[2].float(), atol=scale.item() * 1e-6, rtol=ulp, name="grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch, T, heads, groups, initial, head_dim, d_state", [
    (16, 512, 24, 1, False, 64, 128), (2, 2048, 80, 1, True, 64, 128), (3, 300, 16, 8, True, 64, 128),
    (2, 700, 24, 1, True, 128, 256)])
def test_chunk_scan_forward_gpu(batch, T, heads, groups, initial, head_dim, d_state, dtype):
    """The forward-only scan at the 130m training shape, a 2.7b-shape prefill continuing a state,
    8 groups off the chunk length, and the d_state-256, head-dim-128 preset's shape, against
    naive_chunk_scan (fp32 math) on the same inputs."""
    from ssmspec.ops.chunk_scan.naive import naive_chunk_scan
    from ssmspec.ops.chunk_scan.triton import chunk_scan_forward

    g = torch.Generator(device=DEV).manual_seed(T)
    x = torch.randn(batch, T, heads, head_dim, device=DEV, generator=g).to(dtype)
    dt = torch.nn.functional.softplus(torch.randn(batch, T, heads, device=DEV, generator=g) - 2.0).clamp(1e-3, 0.5)
    A = -torch.exp(0.5 * torch.randn(heads, device=DEV, generator=g))
    B = (0.3 * torch.randn(batch, T, groups, d_state, device=DEV, generator=g)).to(dtype)
    C = (0.3 * torch.randn(batch, T, groups, d_state, device=DEV, generator=g)).to(dtype)
    D = torch.randn(heads, device=DEV, generator=g)
    h0 = torch.randn(batch, heads, head_dim, d_state, device=DEV, generator=g) if initial else None
    got_y, got_f = chunk_scan_forward(x, dt, A, B, C, D, 256, h0)
    want_y, want_f = naive_chunk_scan(x, dt, A, B, C, D, 256, h0)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    scale_y, scale_f = want_y.abs().max().item(), want_f.abs().max().item()
    assert_close(got_y.float(), want_y, atol=tol * scale_y, rtol=tol, name="y")
    assert_close(got_f, want_f, atol=tol * scale_f, rtol=tol, name="final state")
