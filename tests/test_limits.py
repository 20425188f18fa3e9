"""Limits checked before work starts (context, tree width, memory), chunked attention prefill,
the EOS id 0, and the CPU thread default."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import assert_close, tiny_config, tiny_model
from ssmspec import limits, runtime
from ssmspec.decoding import GenerationConfig, ModelDrafter, NgramDrafter, generate
from ssmspec.errors import InputError, ResourceError
from ssmspec.models import attention as attention_module
from ssmspec.models.attention import Attention
from ssmspec.models.loading import LoadedModel
from ssmspec.trees import Tree

HYBRID = ("mamba", "attention", "mlp", "attention")


# -----------------------------------------------------------------------------------------------
# chunked attention prefill
# -----------------------------------------------------------------------------------------------
@pytest.fixture
def small_chunks(monkeypatch):
    """Every multi-token forward attends in chunks of 5 queries."""
    monkeypatch.setattr(attention_module, "ATTENTION_SCORE_ELEMENTS", 1)
    monkeypatch.setattr(attention_module, "MIN_QUERY_CHUNK", 5)


def _layer_and_cache(batch, prefix, capacity=80):
    cfg = tiny_config(HYBRID).attention
    layer = Attention(32, cfg).eval()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    cache = layer.new_cache(batch, capacity, "cpu", torch.float32)
    cache.keys.normal_()
    cache.values.normal_()  # garbage past each row's length must stay invisible
    return layer, cache, torch.tensor(prefix)


@pytest.mark.parametrize("steps", [6, 23, 63])
@pytest.mark.parametrize("prefix", [[0], [7], [3, 11]])
def test_chunked_attention_equals_the_full_pass(monkeypatch, steps, prefix):
    layer, cache, seqlen = _layer_and_cache(len(prefix), prefix)
    h = torch.randn(len(prefix), steps, 32)
    ref_cache = type(cache)(cache.keys.clone(), cache.values.clone())
    with torch.no_grad():
        expected = layer(h, ref_cache, seqlen)
        monkeypatch.setattr(attention_module, "ATTENTION_SCORE_ELEMENTS", 1)
        monkeypatch.setattr(attention_module, "MIN_QUERY_CHUNK", 5)
        actual = layer(h, cache, seqlen)
    assert_close(actual, expected, name="output")
    assert_close(cache.keys, ref_cache.keys, name="keys written")
    assert_close(cache.values, ref_cache.values, name="values written")


@pytest.mark.parametrize("steps", [9, 40])
def test_chunked_attention_without_a_cache(monkeypatch, steps):
    layer, _, _ = _layer_and_cache(2, [0, 0])
    h = torch.randn(2, steps, 32)
    with torch.no_grad():
        expected = layer(h)
        monkeypatch.setattr(attention_module, "ATTENTION_SCORE_ELEMENTS", 1)
        monkeypatch.setattr(attention_module, "MIN_QUERY_CHUNK", 5)
        actual = layer(h)
    assert_close(actual, expected, name="output")
    # Training keeps the one-call path (each chunk's probabilities would be kept for the backward).
    monkeypatch.setattr(Attention, "_attend_in_chunks", lambda *a: pytest.fail("chunked under autograd"))
    trained = layer(h.requires_grad_())
    assert_close(trained, expected, name="output with autograd")
    trained.sum().backward()
    assert layer.q_proj.weight.grad is not None


def test_chunked_prefill_continues_like_the_full_one(small_chunks, monkeypatch):
    """Prefill in chunks, then step: the same logits as the model without chunking."""
    model = tiny_model(HYBRID)
    prompt = torch.randint(0, 64, (1, 37))
    with torch.no_grad():
        cache = model.new_cache(1, 60)
        chunked = model(prompt, cache)
        chunked_step = model.step(torch.tensor([[5]]), cache)
        monkeypatch.setattr(attention_module, "ATTENTION_SCORE_ELEMENTS", 1 << 40)
        ref_cache = model.new_cache(1, 60)
        full = model(prompt, ref_cache)
        full_step = model.step(torch.tensor([[5]]), ref_cache)
    assert_close(chunked, full, name="prefill logits")
    assert_close(chunked_step, full_step, name="next step logits")


MEMORY_PROBE = textwrap.dedent("""
    import resource, sys, torch
    torch.set_num_threads(1)
    from ssmspec.limits import estimate_generation
    from ssmspec.models.presets import build_model
    tokens = int(sys.argv[1])
    model = build_model("tiny-hybrid")
    ids = torch.randint(0, 256, (1, tokens))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.no_grad():
        model(ids, model.new_cache(1, tokens + 64), last_only=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    estimate = estimate_generation(model.config, tokens, tokens + 64, 4).total
    print(peak - before, estimate)
""")


@pytest.mark.parametrize("tokens", [8000, pytest.param(20000, marks=pytest.mark.slow)])
def test_long_prompt_prefill_memory_is_linear(tokens):
    """tiny-hybrid on a long prompt: a T x (cache + T) score matrix would need 2 GB at 8k tokens
    (13 GB at 20k); chunked, the prefill stays near its linear estimate."""
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tokens)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    grown, estimate = map(int, out.stdout.split())
    quadratic = 4 * 4 * tokens * 2 * tokens  # fp32 scores, 4 heads, keys = cache + new
    assert grown < 40 * tokens * 1024, f"prefill of {tokens} tokens grew RSS by {grown / 2**20:.0f} MiB"
    assert grown < quadratic / 8
    assert grown < 1.5 * estimate, f"measured {grown / 2**20:.0f} MiB, estimated {estimate / 2**20:.0f} MiB"


# -----------------------------------------------------------------------------------------------
# refusals before work starts
# -----------------------------------------------------------------------------------------------
def test_tree_wider_than_the_vocabulary_is_refused():
    target = tiny_model(vocab_size=8)
    drafter = ModelDrafter(tiny_model(vocab_size=8, seed=1))
    config = GenerationConfig(method="stree", tree=Tree.from_config((300,)), max_new_tokens=4)
    with pytest.raises(InputError, match="needs up to 300 children per node but the vocabulary has 8 tokens"):
        generate(target, [1, 2, 3], drafter=drafter, config=config)
    with pytest.raises(InputError, match="children per node"):  # a deeper level too, and prompt lookup
        generate(target, [1, 2, 3], drafter=NgramDrafter(),
                 config=GenerationConfig(method="stree", tree=Tree.from_config((2, 9)), max_new_tokens=4))
    # At the vocabulary's size it runs.
    out = generate(target, [1, 2, 3], drafter=drafter,
                   config=GenerationConfig(method="stree", tree=Tree.from_config((8,)), max_new_tokens=4))
    assert len(out.token_ids) == 4


def test_context_refusal_names_the_lengths():
    cfg = tiny_config(HYBRID)
    limits.check_context(cfg, 90, 10, declared=100)
    with pytest.raises(InputError, match=r"prompt \(90 tokens\) \+ --max-new-tokens 11 need 101 positions.*100"):
        limits.check_context(cfg, 90, 11, declared=100)
    with pytest.raises(InputError, match=r"\+ 7 tree nodes"):
        limits.check_context(cfg, 90, 5, tree_nodes=7, declared=100)
    # Pure Mamba-2 has no context beyond memory, whatever the config declares.
    limits.check_context(tiny_config(), 10**9, 10**9, declared=100)
    # Rotary attention without a declared context: fp32 positions are exact up to 2**24.
    with pytest.raises(InputError, match="rotary positions are exact"):
        limits.check_context(cfg, 10, limits.ROPE_EXACT_POSITIONS)
    # Attention without positions (NoPE) and nothing declared: memory is the limit.
    nope = tiny_config(HYBRID)
    nope.attention.rotary_dim = 0
    limits.check_context(nope, 10, 10**12)


def test_generate_text_refuses_beyond_the_declared_context(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bamba", "max_position_embeddings": 64}))
    loaded = LoadedModel(tiny_model(HYBRID, vocab_size=256), None, "bamba", tmp_path)
    from ssmspec.api import generate_text

    result = generate_text(loaded, "abc", config=GenerationConfig(method="ar", max_new_tokens=8))
    assert len(result.token_ids) == 8
    with pytest.raises(InputError, match="declares a context of 64 positions"):
        generate_text(loaded, "x" * 60, config=GenerationConfig(method="ar", max_new_tokens=8))


def test_memory_refusal_gives_both_sizes():
    nope = tiny_config(HYBRID)
    nope.attention.rotary_dim = 0
    from ssmspec.models import LanguageModel

    target = LanguageModel(nope).eval()
    config = GenerationConfig(method="ar", max_new_tokens=10**11)  # a 2.9 TiB KV cache
    with pytest.raises(ResourceError) as err:
        generate(target, [1, 2, 3], config=config)
    message = str(err.value)
    assert "\n" not in message
    assert "needs about" in message and "caches" in message and "available" in message
    free, _ = limits.available_bytes("cpu")
    assert f"{free / 2**30:.0f} GiB available" in message or f"{free / 2**30:.2f} GiB available" in message


def test_gpu_room_is_the_free_memory_plus_the_allocators_reusable_blocks(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * gib, 80 * gib))
    stats = {"reserved_bytes": {"all": {"current": 3 * gib}}, "allocated_bytes": {"all": {"current": 1 * gib}}}
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: stats)
    assert limits.available_bytes("cuda:0") == (6 * gib, "cuda:0 has")


def test_memory_estimate_counts_caches_and_the_drafter():
    cfg = tiny_config(HYBRID)
    alone = limits.estimate_generation(cfg, 100, 1000, 4)
    # Two attention layers, 2 KV heads of 8 dims, keys and values, fp32; Mamba states are small.
    assert 2 * 2 * 2 * 1000 * 8 * 4 < alone.caches < 2 * 2 * 2 * 1000 * 8 * 4 + 10_000
    with_drafter = limits.estimate_generation(cfg, 100, 1000, 4, drafter_cfg=tiny_config(), tree_nodes=7)
    assert with_drafter.caches > alone.caches
    assert limits.estimate_generation(cfg, 100, 2000, 4).caches > alone.caches
    assert limits.estimate_generation(cfg, 10_000, 11_000, 4).activations > 10 * alone.activations


def test_max_new_tokens_must_be_an_integer():
    for bad in (1e9, "12", True, 0):
        with pytest.raises(InputError, match="max-new-tokens must be a positive integer"):
            GenerationConfig(max_new_tokens=bad)


# -----------------------------------------------------------------------------------------------
# EOS id 0
# -----------------------------------------------------------------------------------------------
class _EosZeroTokenizer:
    """A tokenizer whose end-of-sequence id is 0."""

    eos_token_id = 0
    chat_template = None

    def encode(self, text):
        return [1 + (b % 200) for b in text.encode()]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(65 + i % 26) for i in ids)


def test_generate_text_honours_an_eos_id_of_zero(tmp_path):
    from ssmspec.api import generate_text

    model = tiny_model(vocab_size=256)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit equal: greedy argmax picks token 0
    model.config.eos_token_id = 7
    loaded = LoadedModel(model, _EosZeroTokenizer(), "ssmspec", tmp_path)
    result = generate_text(loaded, "hello", config=GenerationConfig(method="ar", max_new_tokens=10))
    assert result.token_ids == [0]
    assert result.finish_reason == "eos"


# -----------------------------------------------------------------------------------------------
# CPU threads
# -----------------------------------------------------------------------------------------------
@pytest.fixture
def threads_restored(monkeypatch):
    from ssmspec.ops import settings

    before = torch.get_num_threads()
    for name in (runtime.THREADS_ENV, *runtime.USER_THREAD_ENVS):
        monkeypatch.delenv(name, raising=False)
    settings.environment.cache_clear()  # read once a process: read the changed environment
    yield
    monkeypatch.undo()
    settings.environment.cache_clear()
    torch.set_num_threads(before)


def test_small_models_decode_on_one_thread(threads_restored, monkeypatch):
    monkeypatch.setattr(runtime, "_STARTUP_THREADS", torch.get_num_threads())
    assert runtime.configure_threads(tiny_model()) == 1
    assert torch.get_num_threads() == 1
    assert runtime.default_threads(10**9) == max(1, min(runtime._STARTUP_THREADS, runtime.usable_cores()))


def test_thread_count_set_by_the_user_is_kept(threads_restored, monkeypatch):
    from ssmspec.ops import settings

    def setenv(name, value):  # the environment is read once a process: read it again here
        if value is None:
            monkeypatch.delenv(name)
        else:
            monkeypatch.setenv(name, value)
        settings.environment.cache_clear()

    setenv(runtime.THREADS_ENV, "2")
    assert runtime.configure_threads(tiny_model()) == 2 == torch.get_num_threads()
    setenv(runtime.THREADS_ENV, "none")
    with pytest.raises(InputError, match="SSMSPEC_THREADS"):
        runtime.configure_threads(tiny_model())
    setenv(runtime.THREADS_ENV, None)
    setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)
    assert runtime.configure_threads(tiny_model()) == 3
    setenv("OMP_NUM_THREADS", None)
    # A count the caller set with torch itself (neither torch's start-up count nor ours) is kept.
    monkeypatch.setattr(runtime, "_STARTUP_THREADS", 5)
    monkeypatch.setattr(runtime, "_chosen", None)
    torch.set_num_threads(3)
    assert runtime.configure_threads(tiny_model()) == 3


def test_generate_text_reports_the_thread_count(tmp_path, threads_restored, monkeypatch):
    from ssmspec.api import generate_text
    from ssmspec.ops import settings

    monkeypatch.setenv(runtime.THREADS_ENV, "1")
    settings.environment.cache_clear()
    loaded = LoadedModel(tiny_model(vocab_size=256), None, "ssmspec", tmp_path)
    result = generate_text(loaded, "hi", config=GenerationConfig(method="ar", max_new_tokens=3))
    assert result.stats["cpu_threads"] == 1
