"""Greedy speculative decoding reproduces transformers' own greedy `generate`, token for token."""
from __future__ import annotations

import pytest
import torch

from helpers import tiny_model
from ssmspec.decoding import GenerationConfig, ModelDrafter, NgramDrafter, generate
from ssmspec.models.loading import load_model
from ssmspec.trees import Tree
from test_transformers_equivalence import randomize

transformers = pytest.importorskip("transformers")

VOCAB = 97
NEW_TOKENS = 20


def _mamba2():
    # No time-step clamp: transformers' cached single-token path skips it, so with a clamp its
    # own generate would disagree with its own full forward.
    cfg = transformers.Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_heads=8, head_dim=8,
                                    expand=2, state_size=8, n_groups=2, conv_kernel=4, chunk_size=8,
                                    tie_word_embeddings=False)
    model = transformers.Mamba2ForCausalLM(cfg)
    randomize(model, seed=11)
    return model


def _nemotron_h():
    cfg = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32,
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention", "full_attention", "mlp"],
        mamba_num_heads=8, mamba_head_dim=6, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40, mlp_hidden_act="relu2",
        time_step_min=1e-6, tie_word_embeddings=False)
    model = transformers.NemotronHForCausalLM(cfg)
    randomize(model, seed=12)
    return model


def _bamba():
    cfg = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, attn_layer_indices=[1], num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=40, mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2,
        mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0}, tie_word_embeddings=False)
    model = transformers.BambaForCausalLM(cfg)
    randomize(model, seed=13)
    return model


@pytest.fixture(scope="module", params=["mamba2", "nemotron_h", "bamba"])
def checkpoint(request, tmp_path_factory):
    ref = {"mamba2": _mamba2, "nemotron_h": _nemotron_h, "bamba": _bamba}[request.param]()
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
