"""The fast path's loops that queue the next call before reading the last one (decoding/generate.py
`_step_ahead`, `_speculate_ahead`) on real CUDA graphs and asynchronous read-backs (opt in:
--run-gpu). On the CPU the copies are synchronous, so only a GPU can show a read that overtakes its
copy. ar and fixed trees, bf16: the same ids as reading each call first (timing=True), greedy and
sampled with a seed. A bandit picks its trees a step late, so other trees than when reading each
first: fp32 and greedy, its ids must equal ar's."""
from __future__ import annotations

import functools

import pytest
import torch

from ssmspec.decoding import Engine, GenerationConfig, ModelDrafter
from ssmspec.models.presets import build_model
from ssmspec.trees import Tree
from ssmspec.trees.tree import parse_tree_spec

pytestmark = pytest.mark.requires_cuda
VOCAB = 8192
PROMPT = torch.randint(0, VOCAB, (90,), generator=torch.Generator().manual_seed(4)).tolist()


@functools.cache
def pair(dtype):
    target = build_model("mamba2-130m", vocab_size=VOCAB, seed=1, dtype=dtype, device="cuda")
    drafter = build_model("drafter-2l", vocab_size=VOCAB, seed=2, dtype=dtype, device="cuda")
    return target, drafter


@pytest.mark.parametrize("method, tree", [("ar", None), ("stree", (3, 2, 1)), ("chain", (1, 1, 1, 1))])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_ahead_equals_reading_each_call_first(method, tree, temperature):
    target, drafter = pair(torch.bfloat16)
    engine = Engine(target, None if method == "ar" else ModelDrafter(drafter))
    ids = {}
    for timing in (True, False, False):  # the second one-ahead run replays the graphs the first captured
        cfg = GenerationConfig(method=method, tree=None if tree is None else Tree.from_config(tree), max_new_tokens=96,
                               temperature=temperature, seed=11, timing=timing)
        ids.setdefault(timing, []).append(engine.generate(PROMPT, cfg).token_ids)
    assert ids[False][0] == ids[True][0] == ids[False][1]


def test_a_bandit_one_ahead_keeps_the_ids_of_ar_in_fp32():
    target, drafter = pair(torch.float32)
    ar = Engine(target).generate(PROMPT, GenerationConfig(method="ar", max_new_tokens=96)).token_ids
    engine = Engine(target, ModelDrafter(drafter))
    cfg = GenerationConfig(method="stree", tree=parse_tree_spec("bandit:3,2,1;1,1,1,1;2,2,1"), max_new_tokens=96)
    for _ in range(2):
        out = engine.generate(PROMPT, cfg)
        assert out.token_ids == ar
        assert sum(out.stats["tree_policy"]["pulls"]) >= out.stats["target_calls"]
