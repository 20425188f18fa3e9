"""Our model's three paths agree: forward, step after prefill, verify on trees, and replay."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_caches_equal, assert_close, tiny_model
from ssmspec.trees import Tree

ARCHS = {
    "mamba2": ("mamba", "mamba"),
    "hybrid": ("mamba", "attention", "mlp", "mamba", "attention"),
    "attention-first": ("attention", "mlp", "mamba"),
}
TREES = [Tree.chain(0), Tree.chain(6), Tree.from_config((2, 2, 1)), Tree.from_config((4, 1)),
         Tree.from_parents([-1, 0, 0, 1, 1, 3, 2, 6, 7])]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_steps_equal_full_forward(arch):
    model = tiny_model(ARCHS[arch])
    ids = torch.randint(0, 64, (3, 19))
    full = model(ids)
    cache = model.new_cache(3, 32)
    assert_close(model(ids[:, :11], cache), full[:, :11], atol=1e-5, name="prefill")
    steps = torch.cat([model.step(ids[:, t:t + 1], cache) for t in range(11, 19)], dim=1)
    assert_close(steps, full[:, 11:], atol=1e-5, name="steps")
    assert cache.seqlen.tolist() == [19, 19, 19]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.spec() or "root")
def test_verify_equals_decoding_each_path_alone(arch, tree):
    model = tiny_model(ARCHS[arch])
    batch, prompt_len = 2, 7
    ids = torch.randint(0, 64, (batch, prompt_len))
    tokens = torch.randint(0, 64, (batch, tree.num_nodes))
    cache = model.new_cache(batch, 32)
    model(ids, cache)
    before = cache.clone()
    logits, _ = model.verify(tokens, tree, cache)
    for node in range(tree.num_nodes):
        path_cache = before.clone()
        for n in tree.path(node):  # the sequential reference: step along the path alone
            out = model.step(tokens[:, n:n + 1], path_cache)
        assert_close(logits[:, node], out[:, 0], atol=1e-5, name=f"node {node}")
    assert_caches_equal(cache, before)  # verify wrote nothing


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_equals_stepping_the_accepted_tokens(arch):
    model = tiny_model(ARCHS[arch])
    tree = Tree.from_config((3, 2, 2))
    batch = 3
    ids = torch.randint(0, 64, (batch, 6))
    tokens = torch.randint(0, 64, (batch, tree.num_nodes))
    cache = model.new_cache(batch, 32)
    model(ids, cache)
    stepped = cache.clone()
    _, acts = model.verify(tokens, tree, cache)
    # A different accepted path per row: full depth, partial, root only.
    paths = [tree.path(tree.leaves()[-1]), tree.path(2), [0]]
    width = max(map(len, paths))
    path = torch.tensor([p + [0] * (width - len(p)) for p in paths])
    model.replay(cache, acts, path, torch.tensor([len(p) for p in paths]))
    # Reference: each row steps its own accepted tokens one by one.
    for row, p in enumerate(paths):
        row_cache = stepped.select(torch.tensor([row]))
        for n in p:
            model.step(tokens[row:row + 1, n:n + 1], row_cache)
        assert_caches_equal(cache.select(torch.tensor([row])), row_cache)
    # And decoding continues from the replayed cache as from the stepped one.
    nxt = torch.randint(0, 64, (batch, 1))
    out = model.step(nxt, cache)
    for row, p in enumerate(paths):
        seq = torch.cat([ids[row], tokens[row, p], nxt[row]])[None]
        assert_close(out[row, 0], model(seq)[0, -1], atol=1e-5, name=f"row {row} after replay")


def test_bf16_model_runs_with_fp32_state():
    model = tiny_model(ARCHS["hybrid"]).to(torch.bfloat16)
    cache = model.new_cache(1, 16)
    model(torch.randint(0, 64, (1, 5)), cache)
    assert cache.layers[0].ssm_state.dtype == torch.float32
    logits, acts = model.verify(torch.randint(0, 64, (1, 7)), Tree.from_config((2, 2)), cache)
    assert torch.isfinite(logits).all()
    model.replay(cache, acts, torch.tensor([[0, 2, 6]]), torch.tensor([3]))
    assert cache.seqlen.item() == 8


@pytest.mark.parametrize("layers", [("mamba", "mamba"), ("mamba", "mlp", "attention", "mlp", "mamba")],
                         ids=["mamba", "hybrid"])
def test_folding_norm_weights_keeps_the_function(layers):
    """models/fold.py moves every Mamba / MLP sublayer's norm weights into the projections after
    them: forward, step and verify give the same logits (fp32), the folded norms are ones and
    marked, and touching a folded norm's weight clears the mark (the fused routes are then off)."""
    import copy

    from ssmspec.models.fold import is_folded

    model = tiny_model(layers)
    with torch.no_grad():  # norm weights away from one, or folding would be a no-op
        for layer in model.layers:
            layer.norm.weight.uniform_(0.5, 1.5)
            if layer.kind == "mamba":
                layer.mixer.norm.weight.uniform_(0.5, 1.5)
    folded = copy.deepcopy(model).fold_norm_weights_()
    for layer, orig in zip(folded.layers, model.layers):
        assert layer.norms_folded == (layer.kind != "attention")
        if layer.kind != "attention":
            assert torch.equal(layer.norm.weight, torch.ones_like(layer.norm.weight))
            proj = "in_proj" if layer.kind == "mamba" else "up_proj"
            assert not torch.equal(getattr(layer.mixer, proj).weight, getattr(orig.mixer, proj).weight)
    before = [p.clone() for p in folded.parameters()]
    folded.fold_norm_weights_()  # idempotent
    assert all(torch.equal(a, b) for a, b in zip(before, folded.parameters()))

    prompt = torch.randint(0, 64, (2, 6))
    tree = Tree.from_config((2, 2))
    tokens = torch.randint(0, 64, (2, tree.num_nodes))
    outs = []
    for m in (model, folded):
        cache = m.new_cache(2, 32)
        with torch.no_grad():
            logits = m(prompt, cache)
            step = m.step(prompt[:, -1:], cache)
            tree_logits, _ = m.verify(tokens, tree, cache)
        outs.append((logits, step, tree_logits))
    for name, a, b in zip(("forward", "step", "verify"), *outs):
        assert_close(b, a, atol=1e-5, rtol=1e-4, name=name)

    first = next(layer for layer in folded.layers if layer.kind == "mamba")
    with torch.no_grad():
        first.norm.weight.mul_(2.0)
    assert not is_folded(first.norm) and not first.norms_folded


@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-moe-hybrid", "tiny-parallel-hybrid", "tiny-shared-hybrid"])
def test_recomputed_activations_give_the_same_loss_and_gradients(preset):
    """LanguageModel.recompute_activations (sft/distill --recompute): every sublayer kind, parallel
    sublayers and shared-block uses give the loss and gradients of keeping the activations."""
    from ssmspec.models.presets import build_model

    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    results = []
    for recompute in (False, True):
        model = build_model(preset, vocab_size=256, seed=4).train()
        model.recompute_activations = recompute
        loss = torch.nn.functional.cross_entropy(model(ids)[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7, msg=name)
