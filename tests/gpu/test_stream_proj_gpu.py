"""ops/stream_proj on a Hopper GPU (opt in: --run-gpu): the tree verify with its projections on
the weight stream (SSMSPEC_STREAM_LAYERS=1) against the Triton verify it replaces, on bf16 models
of the kernel's shape (d_model 256 and 2560)."""
from __future__ import annotations

import pytest
import torch
from helpers import kernel_shaped_model, rel_err as _rel

from ssmspec.ops import paths
from ssmspec.ops.stream_proj import StreamProj, unsupported_reason
from ssmspec.trees import Tree

pytestmark = pytest.mark.requires_cuda
DEV = "cuda"


def _prefilled(model, prompt, pending=0):
    cache = model.new_cache(1, 64, pending=pending)
    with torch.no_grad():
        model(prompt, cache, last_only=True)
    return cache


def _verify_both(model, tokens, tree, cache):
    with torch.no_grad():
        want = model.verify(tokens, tree, cache)
        with paths.use_stream_layers("on"):
            got = model.verify(tokens, tree, cache)
    return want, got


@pytest.mark.parametrize("config, pending", [((3, 2, 1), 0), ((2, 2), 0), ((3, 2, 1), 16), ((1,), 0)],
                         ids=["16-nodes", "7-nodes", "16-nodes-pending", "2-nodes"])
def test_stream_proj_verify_matches_the_triton_verify(config, pending, triton_backend):
    """Logits and every activation the replay reads agree to bf16 rounding, the runner really
    ran, and the cache is left as it was (verify writes nothing to it)."""
    model = kernel_shaped_model(("mamba",) * 3, DEV)
    tree = Tree.from_config(config)
    cache = _prefilled(model, torch.randint(0, 64, (1, 5), device=DEV), pending)
    if pending:  # two tree iterations' worth of pending inputs first
        tok = torch.randint(0, 64, (1, tree.num_nodes), device=DEV)
        for _ in range(2):
            with torch.no_grad():
                _, acts = model.verify(tok, tree, cache)
                model.replay(cache, acts, torch.tensor([[0, 1, 4]], device=DEV), torch.tensor([3], device=DEV))
        assert int(cache.pending_count[0]) > 0
    before = cache.clone()
    tokens = torch.randint(0, 64, (1, tree.num_nodes), device=DEV)
    (want, want_acts), (got, got_acts) = _verify_both(model, tokens, tree, cache)
    assert isinstance(model.one_launch.kept("verify", model.device), StreamProj)
    assert torch.isfinite(got).all() and _rel(got, want) < 2e-2, _rel(got, want)
    for a, b in zip(got_acts.layers, want_acts.layers):
        for name in ("xBC", "x", "dt", "B"):
            assert _rel(getattr(a, name), getattr(b, name)) < 2e-2, name
    for lc, rc in zip(cache.layers, before.layers):
        assert torch.equal(lc.ssm_state, rc.ssm_state) and torch.equal(lc.conv_state, rc.conv_state)


def test_stream_proj_at_the_mamba2_2p7b_shape(triton_backend, monkeypatch):
    """Two layers of the mamba2-2.7b shape (d_model 2560, 80 heads), 16 nodes: logits to bf16
    rounding of the Triton verify's."""
    import dataclasses

    from ssmspec.models import LanguageModel
    from ssmspec.models.init import init_weights
    from ssmspec.models.presets import preset_config

    cfg = dataclasses.replace(preset_config("mamba2-2.7b", vocab_size=1024), layers=["mamba"] * 2)
    model = init_weights(LanguageModel(cfg), seed=0, std=0.02).eval().to(DEV, torch.bfloat16)
    model.fold_norm_weights_()
    tree = Tree.from_config((3, 2, 1))
    cache = _prefilled(model, torch.randint(0, 1000, (1, 8), device=DEV))
    tokens = torch.randint(0, 1000, (1, tree.num_nodes), device=DEV)
    (want, _), (got, _) = _verify_both(model, tokens, tree, cache)
    assert isinstance(model.one_launch.kept("verify", model.device), StreamProj)
    assert _rel(got, want) < 1e-2, _rel(got, want)


def test_stream_proj_in_a_captured_tree_iteration(triton_backend, monkeypatch):
    """GreedyTreeGraph with the weight-stream projections: every replay from the same cache gives
    the same bits (the grid barrier's tickets carry over between replays), equal to the eager
    iteration's."""
    from ssmspec.decoding.graphs import GreedyTreeGraph

    model = kernel_shaped_model(("mamba",) * 3, DEV)
    tree = Tree.from_config((3, 2, 1))
    cache = _prefilled(model, torch.randint(0, 64, (1, 5), device=DEV), pending=16)
    tokens = torch.randint(0, 64, (1, tree.num_nodes), device=DEV)
    snapshot = cache.clone()
    with paths.use_stream_layers("on"):
        eager = GreedyTreeGraph(model, cache, tree, capture=False)
        want_tokens, want_n = (t.clone() for t in eager(tokens))
        want_cache = cache.clone()
        cache.copy_(snapshot)
        graph = GreedyTreeGraph(model, cache, tree)
    for _ in range(10):
        cache.copy_(snapshot)
        got_tokens, got_n = graph(tokens)
        torch.cuda.synchronize()
        assert torch.equal(got_tokens, want_tokens) and torch.equal(got_n, want_n)
        for lc, rc in zip(cache.layers, want_cache.layers):
            assert torch.equal(lc.ssm_state, rc.ssm_state) and torch.equal(lc.conv_state, rc.conv_state)
            assert torch.equal(lc.pending_x, rc.pending_x)
    assert isinstance(model.one_launch.kept("verify", model.device), StreamProj)


def test_stream_proj_refuses_what_it_cannot_run(triton_backend, monkeypatch):
    """More than 16 rows keep the Triton verify; so do models the kernel does not fit, with the
    reason said."""
    model = kernel_shaped_model(("mamba",) * 2, DEV)
    assert unsupported_reason(model, 16, torch.device(DEV)) is None
    assert "rows" in unsupported_reason(model, 17, torch.device(DEV))
    hybrid = kernel_shaped_model(("mamba", "attention"), DEV)
    assert "Mamba-2" in unsupported_reason(hybrid, 16, torch.device(DEV))
    tree = Tree.from_config((4, 3))  # 17 nodes
    cache = _prefilled(model, torch.randint(0, 64, (1, 5), device=DEV))
    tokens = torch.randint(0, 64, (1, tree.num_nodes), device=DEV)
    (want, _), (got, _) = _verify_both(model, tokens, tree, cache)
    assert model.one_launch.kept("verify", model.device) is None and torch.equal(got, want)


SMALLER_PRESETS = ["mamba2-130m", "mamba2-370m", "mamba2-780m", "mamba2-1.3b"]


def _two_layers_of(preset):
    import dataclasses

    from ssmspec.models import LanguageModel
    from ssmspec.models.init import init_weights
    from ssmspec.models.presets import preset_config

    cfg = dataclasses.replace(preset_config(preset, vocab_size=1024), layers=["mamba"] * 2)
    model = init_weights(LanguageModel(cfg), seed=0, std=0.02).eval().to(DEV, torch.bfloat16)
    model.fold_norm_weights_()
    return model


@pytest.fixture(scope="module")
def extensions_of_the_smaller_presets():
    """Both extensions of every smaller preset's shape built at once (nvcc in parallel: about a
    minute in all, instead of a minute per shape and kernel on a fresh machine)."""
    paths.prebuild([_two_layers_of(p) for p in SMALLER_PRESETS])


@pytest.mark.parametrize("preset", SMALLER_PRESETS)
def test_both_kernels_at_the_smaller_mamba2_preset_shapes(preset, triton_backend, extensions_of_the_smaller_presets):
    """Two layers of each smaller mamba2 preset's shape (d_model 768 to 2048): a 16-node verify and
    a decode step on the one-launch kernels against the Triton ones (the default mode takes them
    at every width their limits allow: this test proves those widths)."""
    from ssmspec.ops import stream_layers

    model = _two_layers_of(preset)
    dev = torch.device(DEV)
    assert stream_layers.unsupported_reason(model, 1, dev) is None and unsupported_reason(model, 16, dev) is None
    tree = Tree.from_config((3, 2, 1))
    cache = _prefilled(model, torch.randint(0, 1000, (1, 8), device=DEV))
    tokens = torch.randint(0, 1000, (1, tree.num_nodes), device=DEV)
    (want, _), (got, _) = _verify_both(model, tokens, tree, cache)
    assert isinstance(model.one_launch.kept("verify", model.device), StreamProj)
    assert torch.isfinite(got).all() and _rel(got, want) < 1e-2, _rel(got, want)
    ref_cache = cache.clone()
    with torch.no_grad():
        for t in torch.randint(0, 1000, (4, 1, 1), device=DEV):
            want = model.step(t, ref_cache)
            with paths.use_stream_layers("on"):
                got = model.step(t, cache)
            assert isinstance(model.one_launch.kept("step", model.device), stream_layers.StreamLayers)
            assert torch.isfinite(got).all() and _rel(got, want) < 2e-2, _rel(got, want)
    for lc, rc in zip(cache.layers, ref_cache.layers):
        assert _rel(lc.ssm_state, rc.ssm_state) < 2e-2
