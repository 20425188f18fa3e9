"""ops/stream_layers on a Hopper GPU (opt in: --run-gpu): the one-launch layer stack against the
Triton decode step it replaces, on a bf16 model of the kernel's shape (d_model 256 and 2560)."""
from __future__ import annotations

import pytest
import torch
from helpers import kernel_shaped_model, rel_err as _rel

from ssmspec.ops import paths
from ssmspec.ops.stream_layers import StreamLayers

pytestmark = pytest.mark.requires_cuda
DEV = "cuda"


def _prefilled(model, prompt):
    cache = model.new_cache(1, 64)
    with torch.no_grad():
        model(prompt, cache, last_only=True)
    return cache


@pytest.mark.parametrize("layers", [2, 5])
def test_stream_layers_step_matches_the_triton_step(layers, triton_backend):
    """Teacher-forced: the same tokens through both steps from copies of one cache; logits and
    every layer's states agree to bf16 rounding, and the streaming runner really ran."""
    model = kernel_shaped_model(("mamba",) * layers, DEV)
    prompt = torch.randint(0, 64, (1, 5), device=DEV)
    ref_cache = _prefilled(model, prompt)
    cache = ref_cache.clone()
    tokens = torch.randint(0, 64, (12, 1, 1), device=DEV)
    with torch.no_grad():
        for t in tokens:
            want = model.step(t, ref_cache)
            with paths.use_stream_layers("on"):
                got = model.step(t, cache)
            assert isinstance(model.one_launch.kept("step", model.device), StreamLayers)
            assert torch.isfinite(got).all()
            assert _rel(got, want) < 2e-2, _rel(got, want)
    for lc, rc in zip(cache.layers, ref_cache.layers):
        assert _rel(lc.ssm_state, rc.ssm_state) < 2e-2
        assert _rel(lc.conv_state, rc.conv_state) < 2e-2
    assert int(cache.seqlen) == int(ref_cache.seqlen)


def test_stream_layers_in_a_cuda_graph(triton_backend, monkeypatch):
    """StepGraph with the streaming runner, teacher-forced on the Triton step graph's greedy
    tokens: logits agree to bf16 rounding, and so does every argmax that is not a near tie (the
    model is bf16, so a token-for-token greedy comparison would hinge on ties)."""
    from ssmspec.decoding.graphs import StepGraph

    model = kernel_shaped_model(("mamba",) * 3, DEV)
    prompt = torch.randint(0, 64, (1, 6), device=DEV)

    def run(feed=None):
        """16 steps of a StepGraph: greedy (feed None) or fed the given tokens; (tokens, logits)."""
        cache = model.new_cache(1, 64)
        with torch.no_grad():
            tok = model(prompt, cache, last_only=True).argmax(-1)
        graph = StepGraph(model, cache)
        tokens, logits = [], []
        for i in range(16):
            logits.append(graph(tok).clone())
            tok = logits[-1].argmax(-1) if feed is None else feed[i]
            tokens.append(tok)
        return tokens, logits

    tokens, ref = run()
    with paths.use_stream_layers("on"):
        _, got = run(tokens)
    assert isinstance(model.one_launch.kept("step", model.device), StreamLayers)
    for want, have in zip(ref, got):
        assert _rel(have, want) < 2e-2
        top = want.float().flatten().topk(2).values
        if top[0] - top[1] > 0.1 * want.float().std():
            assert int(have.argmax()) == int(want.argmax())
