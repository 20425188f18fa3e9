"""Sampling (temperature > 0) on the captured CUDA-graph fast path: exact and reproducible (opt in: --run-gpu)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from helpers import tiny_model
from ssmspec.decoding import Engine, GenerationConfig, ModelDrafter, generate
from ssmspec.decoding.sampling import SamplingParams, probabilities
from ssmspec.trees import Tree

pytestmark = pytest.mark.requires_cuda
DEV = "cuda"
VOCAB = 64
PROMPT = [1, 3, 0, 2, 1, 7]
RUNS = 1500


@torch.no_grad()
def exact_two_tokens(model, params):
    """P(t1, t2) of the model's own sampling after PROMPT: {(t1, t2): p}, from one batched forward."""
    p1 = probabilities(model(torch.tensor([PROMPT], device=DEV))[0, -1], params)  # (V,)
    ids = torch.tensor([PROMPT + [v] for v in range(VOCAB)], device=DEV)
    p2 = probabilities(model(ids)[:, -1], params)  # (V, V): row t1
    joint = (p1[:, None] * p2).cpu()
    return {(a, b): float(joint[a, b]) for a in range(VOCAB) for b in range(VOCAB)}


def chi_square_pvalue(counts, dist, runs):
    """Goodness of fit with the outcomes expecting fewer than 5 draws pooled into one cell."""
    observed, expected, tail_obs, tail_exp = [], [], 0.0, 0.0
    for key, p in dist.items():
        if p * runs >= 5:
            observed.append(counts.get(key, 0))
            expected.append(p * runs)
        else:
            tail_obs += counts.get(key, 0)
            tail_exp += p * runs
    if tail_exp > 0:
        observed.append(tail_obs)
        expected.append(tail_exp)
    scale = sum(observed) / sum(expected)
    return chisquare(observed, [e * scale for e in expected]).pvalue


@pytest.fixture(scope="module")
def pair():
    target = tiny_model(("mamba", "attention", "mamba"), vocab_size=VOCAB, seed=3, std=0.6).to(DEV)
    drafter = tiny_model(("mamba",), vocab_size=VOCAB, seed=4, std=0.6).to(DEV)
    return target, drafter


METHODS = ["ar", "stree", "stree-topk"]
"""stree: children sampled from the drafter, SpecInfer on the device; stree-topk: top-k children
and the naive rule's races (ModelDrafter(sample_children=False))."""


def _drafter(drafter_model, method):
    return None if method == "ar" else ModelDrafter(drafter_model, sample_children=method == "stree")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)],
                         ids=["T1", "topk-topp"])
def test_captured_sampling_matches_the_target_distribution(pair, method, params):
    target, drafter_model = pair
    drafter = _drafter(drafter_model, method)
    tree = Tree.from_config((2, 2)) if drafter else None
    engine = Engine(target, drafter)
    counts = {}
    for seed in range(RUNS):
        cfg = GenerationConfig(method=method.split("-")[0], tree=tree, max_new_tokens=2, seed=seed, **params)
        key = tuple(engine.generate(PROMPT, cfg).token_ids)
        counts[key] = counts.get(key, 0) + 1
    fast = engine.fast_path
    assert fast.capture  # the CUDA graphs ran, not the eager loop
    if drafter is not None:  # the whole iteration (draft, acceptance of its kind) was one captured graph
        iteration = fast.tree_graphs[("fused", tree.parents, method == "stree", SamplingParams(**params))]
        assert iteration.graph is not None and (iteration.verify.draft_q is not None) == (method == "stree")
    assert chi_square_pvalue(counts, exact_two_tokens(target, SamplingParams(**params)), RUNS) > 1e-3


@pytest.mark.parametrize("method", METHODS)
def test_captured_sampling_is_reproducible_with_a_seed(pair, method):
    target, drafter_model = pair
    drafter = _drafter(drafter_model, method)

    def ids(seed):
        cfg = GenerationConfig(method=method.split("-")[0], tree=Tree.from_config((2, 2)) if drafter else None,
                               max_new_tokens=32, temperature=1.0, seed=seed)
        return generate(target, PROMPT, drafter=drafter, config=cfg).token_ids

    assert ids(5) == ids(5)
    assert len({tuple(ids(seed)) for seed in range(4)}) > 1


def test_captured_sampled_children_are_accepted_more_often_than_top_k():
    # A drafter close to the target (perturbed weights): at T=1, children drawn from it and
    # accepted by SpecInfer give clearly more tokens per call than top-k children.
    import copy

    target = tiny_model(("mamba", "attention", "mamba"), vocab_size=VOCAB, seed=3).to(DEV)
    drafter_model = copy.deepcopy(target)
    with torch.no_grad():
        for weight in drafter_model.parameters():
            weight.add_(torch.randn_like(weight) * 0.02)
    mean = {}
    for sample_children in (True, False):
        drafter = ModelDrafter(drafter_model, sample_children=sample_children)
        outs = [generate(target, PROMPT, drafter=drafter, config=GenerationConfig(
            method="stree", tree=Tree.from_config((3, 2, 1)), max_new_tokens=64, temperature=1.0, seed=seed))
            for seed in range(8)]
        produced = sum(o.stats["new_tokens"] - 1 for o in outs)  # the prefill's token is no call's
        mean[sample_children] = produced / sum(o.stats["target_calls"] for o in outs)
    assert mean[True] > 1.5 * mean[False], mean
