"""Transformers causal LMs as targets (models/hf_causal.py): verify, replay and generate against transformers itself."""
from __future__ import annotations

import pytest
import torch

from helpers import assert_close, tiny_model
from ssmspec.decoding import GenerationConfig, ModelDrafter, NgramDrafter, generate
from ssmspec.models.hf_causal import TransformersTarget
from ssmspec.models.loading import load_model
from ssmspec.trees import Tree

transformers = pytest.importorskip("transformers")

VOCAB = 128
NEW_TOKENS = 20
TREES = [Tree.chain(0), Tree.chain(5), Tree.from_config((2, 2, 1)), Tree.from_config((4, 1)),
         Tree.from_parents([-1, 0, 0, 1, 1, 3, 2, 6, 7])]


def _config(family: str, vocab: int):
    """A tiny config of `family`: 2 layers, hidden 64, grouped KV heads."""
    shared = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)
    if family == "llama":
        return transformers.LlamaConfig(**shared)
    if family == "qwen2":  # q/k/v biases
        return transformers.Qwen2Config(**shared)
    if family == "mistral":
        return transformers.MistralConfig(**shared, sliding_window=None)
    if family == "gemma":  # scaled embeddings, head_dim not hidden / heads
        return transformers.GemmaConfig(**shared, head_dim=24)
    raise ValueError(family)


@torch.no_grad()
def hf_model(family: str, vocab: int = VOCAB, seed: int = 0, std: float = 0.15):
    """A random tiny transformers causal LM in fp32 with weights large enough to give peaked logits."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, vocab))
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen))
    return model.eval()


FAMILIES = ["llama", "qwen2", "mistral", "gemma"]


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    hf = hf_model(request.param)
    return hf, TransformersTarget(hf)


@torch.no_grad()
def test_prefill_then_steps_equal_transformers_forward(pair):
    hf, target = pair
    ids = torch.randint(0, VOCAB, (3, 15))
    full = hf(ids).logits
    cache = target.new_cache(3, 32)
    assert_close(target(ids[:, :9], cache), full[:, :9], atol=1e-5, name="prefill")
    steps = torch.cat([target.step(ids[:, t:t + 1], cache) for t in range(9, 15)], dim=1)
    assert_close(steps, full[:, 9:], atol=1e-5, name="steps")
    assert cache.seqlen.tolist() == [15, 15, 15]


@torch.no_grad()
def test_transformers_runs_without_cudnn_attention_and_a_full_cache_is_refused():
    """cuDNN's sdpa plans anew for every new key length (a decode step's): the target's calls
    leave it out, and only them. Writing past the cache's capacity is refused, not clipped."""
    hf = hf_model("qwen2")
    target = TransformersTarget(hf)
    seen = []
    hf.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    cache = target.new_cache(1, 6)
    target(torch.randint(0, VOCAB, (1, 5)), cache)
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()
    with pytest.raises(RuntimeError, match="KV cache of 6 positions is full"):
        target(torch.randint(0, VOCAB, (1, 2)), cache)


@torch.no_grad()
@pytest.mark.parametrize("tree", TREES, ids=lambda t: t.spec() or "root")
def test_verify_equals_each_path_alone_through_transformers(pair, tree):
    hf, target = pair
    batch = 2
    ids = torch.randint(0, VOCAB, (batch, 7))
    tokens = torch.randint(0, VOCAB, (batch, tree.num_nodes))
    cache = target.new_cache(batch, 32)
    target(ids, cache)
    before = cache.clone()
    logits, _ = target.verify(tokens, tree, cache)
    assert logits.dtype == torch.float32 and logits.shape == (batch, tree.num_nodes, VOCAB)
    for node in range(tree.num_nodes):
        alone = torch.cat([ids, tokens[:, tree.path(node)]], dim=1)  # prompt + the node's root-to-node path
        assert_close(logits[:, node], hf(alone).logits[:, -1], atol=1e-5, name=f"node {node}")
    assert cache.seqlen.tolist() == before.seqlen.tolist()  # verify wrote nothing
    for a, b in zip(cache.layers, before.layers):
        assert torch.equal(a.keys[:, :, :7], b.keys[:, :, :7]) and torch.equal(a.values[:, :, :7], b.values[:, :, :7])


@torch.no_grad()
def test_replay_then_step_equals_transformers_on_the_accepted_tokens(pair):
    hf, target = pair
    tree = Tree.from_config((3, 2, 2))
    batch = 3
    ids = torch.randint(0, VOCAB, (batch, 6))
    tokens = torch.randint(0, VOCAB, (batch, tree.num_nodes))
    cache = target.new_cache(batch, 32)
    target(ids, cache)
    stepped = cache.clone()
    _, acts = target.verify(tokens, tree, cache)
    # A different accepted path per row: full depth, partial, root only.
    paths = [tree.path(tree.leaves()[-1]), tree.path(2), [0]]
    width = max(map(len, paths))
    path = torch.tensor([p + [0] * (width - len(p)) for p in paths])
    target.replay(cache, acts, path, torch.tensor([len(p) for p in paths]))
    assert cache.seqlen.tolist() == [6 + len(p) for p in paths]
    for row, p in enumerate(paths):  # exactly the path's keys and values, as stepping its tokens leaves them
        row_cache = stepped.select(torch.tensor([row]))
        for n in p:
            target.step(tokens[row:row + 1, n:n + 1], row_cache)
        length = 6 + len(p)
        for mine, ref in zip(cache.layers, row_cache.layers):
            assert_close(mine.keys[row, :, :length], ref.keys[0, :, :length], atol=1e-5, name=f"row {row} keys")
            assert_close(mine.values[row, :, :length], ref.values[0, :, :length], atol=1e-5, name=f"row {row} values")
    nxt = torch.randint(0, VOCAB, (batch, 1))
    out = target.step(nxt, cache)
    for row, p in enumerate(paths):
        seq = torch.cat([ids[row], tokens[row, p], nxt[row]])[None]
        assert_close(out[row, 0], hf(seq).logits[0, -1], atol=1e-5, name=f"row {row} after replay")


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (9,), generator=g).tolist(), ([4, 8, 15, 16, 23, 42] * 2)[:10]]


@torch.no_grad()
def _transformers_greedy(hf, ids, n=NEW_TOKENS):
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("method, tree", [("ar", None), ("chain", Tree.chain(3)), ("stree", Tree.from_config((3, 2, 1)))],
                         ids=["ar", "chain", "stree"])
def test_greedy_token_ids_equal_transformers_generate(pair, method, tree):
    hf, target = pair
    unrelated = tiny_model(("mamba",), vocab_size=VOCAB, seed=123)
    for ids in _prompts():
        expected = _transformers_greedy(hf, ids)
        drafters = [None] if method == "ar" else [ModelDrafter(unrelated), NgramDrafter()]
        for drafter in drafters:
            got = generate(target, ids, drafter=drafter, config=GenerationConfig(method=method, tree=tree, max_new_tokens=NEW_TOKENS))
            assert got.token_ids == expected, f"{method} with {type(drafter).__name__}"


@pytest.mark.parametrize("config", [(1, 1, 1), (3, 2, 1)])
def test_self_drafting_accepts_every_level(config):
    # The drafter is the same transformers model (ModelDrafter takes any model with step/new_cache).
    target = TransformersTarget(hf_model("llama", seed=2))
    g = len(config)
    ids = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(1)).tolist()
    out = generate(target, ids, drafter=ModelDrafter(target),
                   config=GenerationConfig(method="stree", tree=Tree.from_config(config), max_new_tokens=1 + 5 * (g + 1)))
    assert out.accepted_per_call == [g + 1] * 5


def test_unrelated_drafter_is_often_rejected():
    # Guards the equalities above against a drafter that always agrees.
    target = TransformersTarget(hf_model("llama", seed=1))
    out = generate(target, _prompts()[0], drafter=ModelDrafter(tiny_model(("mamba",), vocab_size=VOCAB, seed=99)),
                   config=GenerationConfig(method="chain", tree=Tree.chain(4), max_new_tokens=30))
    assert out.stats["mean_accepted"] < 2.5


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_load_model_reads_a_transformers_directory(tmp_path, family):
    hf = hf_model(family, seed=4)
    hf.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.source_format == "transformers" and isinstance(loaded.model, TransformersTarget)
    # profile.json and vocabulary checks read the shape: attention layers, so the quadratic cost model
    from ssmspec.models.loading import model_fingerprint
    from ssmspec.profiling.schema import architecture_of, config_summary

    assert architecture_of(loaded.model) == "hybrid" and len(model_fingerprint(loaded.model)) == 16
    assert config_summary(loaded.model)["attention"] == {"n_heads": 4, "n_kv_heads": 2, "head_dim": 16}
    ids = _prompts()[0]
    got = generate(loaded.model, ids, drafter=NgramDrafter(),
                   config=GenerationConfig(method="stree", tree=Tree.from_config((2, 1)), max_new_tokens=NEW_TOKENS))
    assert got.token_ids == _transformers_greedy(hf, ids)


def test_a_cache_past_the_sliding_window_is_refused():
    from ssmspec.errors import InputError

    hf = transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16))
    target = TransformersTarget(hf.eval())
    target.new_cache(1, 16)
    with pytest.raises(InputError, match="sliding window of 16"):
        target.new_cache(1, 17)

@pytest.fixture(scope="module")
def sampling_pair():
    from test_generate import SAMPLE_VOCAB

    target = TransformersTarget(hf_model("llama", vocab=SAMPLE_VOCAB, seed=3, std=0.6))
    drafter = tiny_model(("mamba",), vocab_size=SAMPLE_VOCAB, seed=4, std=0.6)
    return target, drafter, [1, 3, 0, 2, 1]


@pytest.mark.parametrize("method, tree", [("chain", Tree.chain(2)), ("stree", Tree.from_config((2, 2)))])
def test_sampling_matches_the_target_distribution(sampling_pair, method, tree):
    # The chi-square check of tests/test_generate.py, with a Llama target at a 4-token vocabulary.
    from test_generate import RUNS, chi_square_pvalue, empirical, exact_joint

    target, drafter, prompt = sampling_pair
    counts = empirical(target, prompt, lambda: ModelDrafter(drafter), method, tree, RUNS)
    assert chi_square_pvalue(counts, exact_joint(target, prompt), RUNS) > 1e-3


def test_sampling_check_has_power(sampling_pair):
    # The same test tells the drafter's own samples apart from this target's.
    from test_generate import RUNS, chi_square_pvalue, empirical, exact_joint

    target, drafter, prompt = sampling_pair
    counts = empirical(drafter, prompt, None, "ar", None, RUNS)
    assert chi_square_pvalue(counts, exact_joint(target, prompt), RUNS) < 1e-3


# -- real weights (slow) ----------------------------------------------------------------------

REAL_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def qwen_coder():
    """Qwen2.5-Coder-0.5B-Instruct, written by `python scripts/fetch_gguf.py qwen2.5-coder-0.5b --out DIR`
    with DIR in SSMSPEC_QWEN_CODER_DIR (skipped where it is not set)."""
    import os

    path = os.environ.get("SSMSPEC_QWEN_CODER_DIR")
    if not path:
        pytest.skip("set SSMSPEC_QWEN_CODER_DIR to a directory written by scripts/fetch_gguf.py qwen2.5-coder-0.5b")
    return load_model(path, dtype="fp32")


@pytest.mark.slow
def test_qwen_coder_greedy_equals_transformers_generate_on_humaneval(qwen_coder):
    from ssmspec.benchmark.prompts import encode, load_prompts

    target, tokenizer = qwen_coder.model, qwen_coder.tokenizer
    assert qwen_coder.source_format == "transformers" and target.hf.config.model_type == "qwen2"
    untrained = tiny_model(("mamba",), vocab_size=target.config.vocab_size, seed=7)
    _, prompts = load_prompts("humaneval")
    for prompt in prompts[:3]:
        ids = encode(tokenizer, prompt)
        expected = _transformers_greedy(target.hf, ids, REAL_NEW_TOKENS)
        for method, tree, drafter in [("stree", Tree.from_config((3, 2, 1)), ModelDrafter(untrained)),
                                      ("chain", Tree.chain(4), NgramDrafter()),
                                      ("stree", Tree.from_config((2, 2, 1, 1)), NgramDrafter())]:
            got = generate(target, ids, drafter=drafter,
                           config=GenerationConfig(method=method, tree=tree, max_new_tokens=REAL_NEW_TOKENS))
            assert got.token_ids == expected, f"{prompt.id}: {method} {tree.spec()} with {type(drafter).__name__}"

