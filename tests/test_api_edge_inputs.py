"""The Python API and `profile` on edge inputs (a bug hunt): prompts that are not one sequence of
token ids, GenerationConfig values of the wrong type, drafters that cannot draft for the target,
generate_text and the caller's config, profile's drafter levels wider than the vocabulary."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import tiny_model
from ssmspec.api import generate_text
from ssmspec.decoding import Engine, GenerationConfig, ModelDrafter, NgramDrafter, generate
from ssmspec.errors import InputError
from ssmspec.models.loading import LoadedModel
from ssmspec.profiling import ProfileSettings, run_profile
from ssmspec.trees import Tree, TreeArms

PROMPT = [5, 9, 2, 7]


@pytest.fixture(scope="module")
def target():
    return tiny_model(("mamba", "mlp"), seed=1)


def ar(target, prompt, n=6, **kw):
    return generate(target, prompt, config=GenerationConfig(method="ar", max_new_tokens=n, **kw)).token_ids


# -- prompts ---------------------------------------------------------------------------------------

def test_one_sequence_in_any_form_gives_the_same_ids(target):
    ids = ar(target, PROMPT)
    for form in (tuple(PROMPT), torch.tensor(PROMPT), torch.tensor([PROMPT]), np.array(PROMPT)):
        assert ar(target, form) == ids


@pytest.mark.parametrize("prompt, mentions", [
    (torch.tensor([PROMPT, PROMPT]), "one sequence at a time"),  # was flattened into one prompt of 8 tokens
    ([PROMPT, [1, 2, 3, 4]], "one sequence at a time"),
    ([1.5, 2.7], "integer token ids"),  # was truncated to [1, 2]
    ([True, False], "integer token ids"),
    ([64], "outside the model's vocabulary"),  # was an IndexError in the embedding
    ([3, -1], "outside the model's vocabulary"),
    ("hello", "generate_text"),
    ([], "empty"),
])
def test_prompts_that_are_not_one_sequence_of_ids_are_refused(target, prompt, mentions):
    with pytest.raises(InputError, match=mentions):
        generate(target, prompt, config=GenerationConfig(method="ar", max_new_tokens=2))


# -- GenerationConfig --------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, mentions", [
    (dict(top_k=1.5, temperature=1.0), "top-k"),  # was a TypeError in torch.topk mid-generation
    (dict(top_k="5"), "top-k"),
    (dict(temperature="0.7"), "temperature"),
    (dict(temperature=math.nan), "temperature"),  # passed `< 0`, then sampled from NaN
    (dict(top_p="1"), "top-p"),
    (dict(seed="1", temperature=1.0), "seed"),  # failed in torch.manual_seed after the prefill
    (dict(seed=1.5), "seed"),
    (dict(seed=2 ** 70), "seed"),
    (dict(tree=(2, 1)), "tree must be a Tree"),  # an AttributeError mid-generation
    (dict(eos_token_id="1"), "eos_token_id"),  # a set of characters, never matched
    (dict(eos_token_id=torch.tensor(3)), "eos_token_id"),
    (dict(stop_strings=[""]), "non-empty"),  # stopped after the first token
    (dict(method="chain", tree=TreeArms((Tree.chain(4), Tree.from_config((2, 1))))), "needs a chain"),
])
def test_generation_config_refuses_wrong_values_at_once(kw, mentions):
    with pytest.raises(InputError, match=mentions):
        GenerationConfig(**kw)


def test_one_stop_string_given_as_a_string_is_one_stop_string(target):
    ids = ar(target, PROMPT, 8)
    decode = lambda toks: " ".join(f"t{t}" for t in toks)  # noqa: E731
    stop = decode(ids[2:4])
    assert GenerationConfig(stop_strings=stop).stop_strings == (stop,)
    # Iterated as characters, its "t" stopped at the first token.
    out = generate(target, PROMPT, config=GenerationConfig(method="ar", max_new_tokens=8, stop_strings=stop),
                   decode=decode)
    assert out.token_ids == ids[:4] and out.finish_reason == "stop_string"


def test_stop_strings_without_decode_are_refused_not_ignored(target):
    with pytest.raises(InputError, match="decode"):
        generate(target, PROMPT, config=GenerationConfig(method="ar", stop_strings=["x"]))


def test_a_numpy_eos_id_stops(target):
    ids = ar(target, PROMPT, 8)
    out = generate(target, PROMPT, config=GenerationConfig(method="ar", max_new_tokens=8,
                                                           eos_token_id=np.int64(ids[2])))
    assert out.token_ids == ids[:ids.index(ids[2]) + 1] and out.finish_reason == "eos"


# -- drafters -------------------------------------------------------------------------------------

def test_a_drafter_that_cannot_draft_for_the_target_is_refused(target):
    with pytest.raises(InputError, match=r"ModelDrafter\(model\)"):  # was AttributeError: no 'begin'
        generate(target, PROMPT, drafter=tiny_model(seed=2), config=GenerationConfig(max_new_tokens=2))
    other = ModelDrafter(tiny_model(seed=2, vocab_size=128))  # its tokens indexed past the target's embedding
    with pytest.raises(InputError, match="vocabulary"):
        Engine(target, other).generate(PROMPT, GenerationConfig(max_new_tokens=2))
    ngram = Engine(target, NgramDrafter()).generate(PROMPT, GenerationConfig(max_new_tokens=6))
    assert ngram.token_ids == ar(target, PROMPT)


# -- generate_text ---------------------------------------------------------------------------------

def test_generate_text_leaves_the_callers_config_as_given():
    model = tiny_model(("mamba",), vocab_size=256, seed=3)
    ids = ar(model, list(b"hello"), 6)
    model.config.eos_token_id = ids[1]
    loaded = LoadedModel(model, None, "ssmspec", Path("/nonexistent"))  # bytes for tokens
    config = GenerationConfig(method="ar", max_new_tokens=6)
    assert generate_text(loaded, "hello", config=config).finish_reason == "eos"
    # Set on the config before, this target's EOS stopped a later call with another target.
    assert config.eos_token_id is None


def test_generation_stops_at_every_eos_id_the_checkpoint_lists(tmp_path):
    # transformers stops at any id of generation_config.json's eos list (Llama 3, Qwen 2.5 list
    # several); only the tokenizer's (or config.json's) one was used, so a generation ran on.
    import json

    model = tiny_model(("mamba",), vocab_size=256, seed=3)
    ids = ar(model, list(b"hello"), 6)
    model.config.eos_token_id = 255 if 255 not in ids else 254
    loaded = LoadedModel(model, None, "ssmspec", tmp_path)
    config = GenerationConfig(method="ar", max_new_tokens=6)
    assert generate_text(loaded, "hello", config=config).finish_reason == "length"
    stop = next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])  # a token not produced before it
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [model.config.eos_token_id, ids[stop]]}))
    result = generate_text(loaded, "hello", config=config)
    assert result.finish_reason == "eos" and result.token_ids == ids[:stop + 1]


# -- profile ---------------------------------------------------------------------------------------

def test_profile_times_drafter_levels_wider_than_the_vocabulary():
    # --sizes up to 128 times drafter levels up to width 128: a (128, 1) probe asked the root for
    # 128 distinct children of a 64-token vocabulary (an IndexError after the target's timings).
    s = ProfileSettings(sizes=(1, 2, 128), methods=("chain",), repeats=1, warmup=0, prompt_len=4, configs=((2, 1),))
    prof = run_profile(tiny_model(("mamba",), seed=1), settings=s, drafter=tiny_model(("mamba",), seed=2))
    assert [r["width"] for r in prof["drafter_timings"]["levels"]][-1] == 128


def test_profile_refuses_before_timing_what_it_cannot_time():
    timed = []
    s = ProfileSettings(sizes=(1, 2, 4), methods=("chain",), repeats=1, warmup=0, prompt_len=4, configs=((65, 1),))
    with pytest.raises(InputError, match="65 children per node"):
        run_profile(tiny_model(("mamba",), seed=1), settings=s, drafter=tiny_model(("mamba",), seed=2),
                    progress=lambda *a: timed.append(a))
    assert not timed
    with pytest.raises(InputError, match="at most 4096"):  # the chain's Tree refused it after timing the rest
        ProfileSettings(sizes=(1, 2, 5000)).validate()
