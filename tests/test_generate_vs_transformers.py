"""Greedy speculative decoding reproduces transformers' own greedy `generate`, token for token."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from ssmspec.decoding import GenerationConfig, ModelDrafter, NgramDrafter, generate
from ssmspec.models.loading import load_model
from ssmspec.trees import Tree

transformers = pytest.importorskip("transformers")
import hf_models  # noqa: E402  (tests/hf_models.py: the tiny transformers oracles)

VOCAB = hf_models.VOCAB
NEW_TOKENS = 20


@pytest.fixture(scope="module", params=["mamba2", "nemotron_h", "bamba", "granitemoehybrid", "falcon_h1", "zamba2"])
def checkpoint(request, tmp_path_factory):
    # No binding time-step clamp: transformers' cached single-token path skips it, so with one
    # its own generate would disagree with its own full forward.
    ref = hf_models.BUILDERS[request.param](clamp=False, seed=11)
    out = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(out)
    return ref, load_model(out).model


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (9,), generator=g).tolist(), ([4, 8, 15, 16, 23, 42] * 2)[:10]]


@torch.no_grad()
def _transformers_greedy(ref, ids):
    out = ref.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("method, tree", [("ar", None), ("chain", Tree.chain(3)), ("stree", Tree.from_config((3, 2, 1)))],
                         ids=["ar", "chain", "stree"])
def test_greedy_token_ids_equal_transformers_generate(checkpoint, method, tree):
    ref, ours = checkpoint
    unrelated = tiny_model(("mamba",), vocab_size=VOCAB, seed=123)
    for ids in _prompts():
        expected = _transformers_greedy(ref, ids)
        drafters = [None] if method == "ar" else [ModelDrafter(unrelated), NgramDrafter()]
        for drafter in drafters:
            got = generate(ours, ids, drafter=drafter, config=GenerationConfig(method=method, tree=tree, max_new_tokens=NEW_TOKENS))
            assert got.token_ids == expected, f"{method} with {type(drafter).__name__}"
