"""Sampling (temperature > 0) on the captured CUDA-graph fast path: exact and reproducible (opt in: --run-gpu)."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from helpers import tiny_model
from ssmspec.decoding import GenerationConfig, ModelDrafter, generate
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


@pytest.mark.parametrize("method", ["ar", "stree"])
@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=5, top_p=0.9)],
                         ids=["T1", "topk-topp"])
def test_captured_sampling_matches_the_target_distribution(pair, method, params):
    target, drafter_model = pair
    drafter = ModelDrafter(drafter_model) if method == "stree" else None
    tree = Tree.from_config((2, 2)) if method == "stree" else None
    counts = {}
    for seed in range(RUNS):
        cfg = GenerationConfig(method=method, tree=tree, max_new_tokens=2, seed=seed, **params)
        key = tuple(generate(target, PROMPT, drafter=drafter, config=cfg).token_ids)
        counts[key] = counts.get(key, 0) + 1
    fast = next(iter(target._ssmspec_fast_paths.values()))
    assert fast.capture  # the CUDA graphs ran, not the eager loop
    assert chi_square_pvalue(counts, exact_two_tokens(target, SamplingParams(**params)), RUNS) > 1e-3


@pytest.mark.parametrize("method", ["ar", "stree"])
def test_captured_sampling_is_reproducible_with_a_seed(pair, method):
    target, drafter_model = pair
    drafter = ModelDrafter(drafter_model) if method == "stree" else None

    def ids(seed):
        cfg = GenerationConfig(method=method, tree=Tree.from_config((2, 2)) if method == "stree" else None,
                               max_new_tokens=32, temperature=1.0, seed=seed)
        return generate(target, PROMPT, drafter=drafter, config=cfg).token_ids

    assert ids(5) == ids(5)
    assert len({tuple(ids(seed)) for seed in range(4)}) > 1
