"""Our forward / step / verify equal transformers' Mamba2, NemotronH and Bamba on tiny random checkpoints.

Each reference model is built by transformers with awkward sizes (2 groups, GQA, partial RoPE,
odd layer patterns), given non-trivial random weights, saved with save_pretrained and read back
with `load_model`. The references are always transformers' full (uncached) forward: its
single-token cached path skips the time-step clamp, ours does not.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from ssmspec.models.loading import load_model
from ssmspec.trees import Tree
from tests.helpers import assert_close

transformers = pytest.importorskip("transformers")
hf_models = pytest.importorskip("hf_models")  # tests/hf_models.py: the tiny transformers oracles

VOCAB = hf_models.VOCAB
PROMPT_LEN = 11  # longer than the chunk size (8), so chunk boundaries are crossed
ATOL, RTOL = 2e-5, 1e-4


def _bamba(intermediate_size: int = 40):
    return hf_models.bamba(intermediate_size=intermediate_size)


BUILDERS = hf_models.BUILDERS


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def pair(request, tmp_path_factory):
    """(transformers model, our loaded model) for one architecture."""
    torch.manual_seed(0)
    ref = BUILDERS[request.param]()
    out = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(out)
    loaded = load_model(out)
    assert loaded.source_format == request.param
    return ref, loaded.model


@torch.no_grad()
def ref_logits(ref, ids: torch.Tensor) -> torch.Tensor:
    return ref(input_ids=ids, use_cache=False).logits.float()


def _prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_forward_matches(pair):
    ref, ours = pair
    ids = _prompt(2, PROMPT_LEN + 6, seed=10)
    expected = ref_logits(ref, ids)
    assert expected.std() > 0.1, "reference logits are flat: the test would prove nothing"
    assert_close(ours(ids), expected, atol=ATOL, rtol=RTOL, name="forward logits")


@torch.no_grad()
def test_prefill_then_step_matches(pair):
    ref, ours = pair
    ids = _prompt(2, PROMPT_LEN + 5, seed=11)
    cache = ours.new_cache(2, max_len=ids.shape[1])
    got = [ours(ids[:, :PROMPT_LEN], cache, last_only=True)]
    for t in range(PROMPT_LEN, ids.shape[1]):
        got.append(ours.step(ids[:, t:t + 1], cache))
    got = torch.cat(got, dim=1)  # logits after positions PROMPT_LEN-1 .. end-1
    expected = ref_logits(ref, ids)[:, PROMPT_LEN - 1:]
    assert_close(got, expected, atol=ATOL, rtol=RTOL, name="prefill + step logits")


def _random_tree(n: int, seed: int) -> Tree:
    rng = random.Random(seed)
    return Tree.from_parents([-1] + [rng.randrange(i) for i in range(1, n)])


TREES = {
    "config-2-2-1": Tree.from_config((2, 2, 1)),
    "chain-5": Tree.chain(5),
    "random-12": _random_tree(12, seed=4),
}


@pytest.mark.parametrize("tree_name", sorted(TREES))
@torch.no_grad()
def test_verify_matches_full_forward_on_each_path(pair, tree_name):
    ref, ours = pair
    tree = TREES[tree_name]
    batch = 2
    prompt = _prompt(batch, PROMPT_LEN, seed=12)
    tokens = _prompt(batch, tree.num_nodes, seed=13)
    cache = ours.new_cache(batch, max_len=PROMPT_LEN + tree.num_nodes)
    ours(prompt, cache)
    logits, _ = ours.verify(tokens, tree, cache)
    assert int(cache.seqlen[0]) == PROMPT_LEN, "verify must not advance the cache"
    expected = torch.empty_like(logits).fill_(float("nan"))
    for node in range(tree.num_nodes):
        path = torch.tensor(tree.path(node))
        seq = torch.cat([prompt, tokens[:, path]], dim=1)
        expected[:, node] = ref_logits(ref, seq)[:, -1]
    assert_close(logits, expected, atol=ATOL, rtol=RTOL, name=f"verify logits on {tree_name}")


# -- mamba_ssm layout, written by hand from a Bamba model -------------------------------------
def _bamba_to_mamba_ssm(ref, out_dir) -> None:
    """Rename / fuse a Bamba checkpoint into mamba_ssm's MambaLMHeadModel layout and config."""
    c = ref.config
    head_dim = c.hidden_size // c.num_attention_heads
    config = {
        "d_model": c.hidden_size, "d_intermediate": c.intermediate_size, "n_layer": c.num_hidden_layers,
        "vocab_size": c.vocab_size, "pad_vocab_size_multiple": 1, "tie_embeddings": False,
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True,
        "ssm_cfg": {
            "layer": "Mamba2", "d_state": c.mamba_d_state, "d_conv": c.mamba_d_conv, "expand": c.mamba_expand,
            "headdim": c.mamba_d_head, "ngroups": c.mamba_n_groups, "chunk_size": c.mamba_chunk_size,
            "dt_limit": list(c.time_step_limit),
        },
        "attn_layer_idx": list(c.attn_layer_indices),
        "attn_cfg": {
            "causal": True, "num_heads": c.num_attention_heads, "num_heads_kv": c.num_key_value_heads,
            "head_dim": head_dim, "rotary_emb_dim": head_dim // 2,
            "rotary_emb_base": c.rope_parameters["rope_theta"], "qkv_proj_bias": False, "out_proj_bias": False,
        },
    }
    sd = ref.state_dict()
    out = {"backbone.embedding.weight": sd["model.embed_tokens.weight"],
           "backbone.norm_f.weight": sd["model.final_layernorm.weight"], "lm_head.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"backbone.layers.{i}."
        out[dst + "norm.weight"] = sd[src + "input_layernorm.weight"]
        out[dst + "norm2.weight"] = sd[src + "pre_ff_layernorm.weight"]
        if i in c.attn_layer_indices:
            a = src + "self_attn."
            out[dst + "mixer.in_proj.weight"] = torch.cat([sd[a + "q_proj.weight"], sd[a + "k_proj.weight"], sd[a + "v_proj.weight"]])
            out[dst + "mixer.out_proj.weight"] = sd[a + "o_proj.weight"]
        else:
            for k, v in sd.items():
                if k.startswith(src + "mamba."):
                    out[dst + "mixer." + k.removeprefix(src + "mamba.")] = v
        f = src + "feed_forward."
        out[dst + "mlp.fc1.weight"] = torch.cat([sd[f + "up_proj.weight"], sd[f + "gate_proj.weight"]])
        out[dst + "mlp.fc2.weight"] = sd[f + "down_proj.weight"]
    torch.save({k: v.clone() for k, v in out.items()}, out_dir / "pytorch_model.bin")
    (out_dir / "config.json").write_text(json.dumps(config))


@torch.no_grad()
def test_mamba_ssm_checkpoint_matches_bamba(tmp_path):
    # GatedMLP rounds its hidden size up to a multiple of 128, so use 128 for an exact match.
    ref = _bamba(intermediate_size=128)
    _bamba_to_mamba_ssm(ref, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.source_format == "mamba_ssm"
    assert loaded.model.config.layers == ["mamba", "mlp", "attention", "mlp", "mamba", "mlp"]
    ids = _prompt(2, PROMPT_LEN + 4, seed=14)
    expected = ref_logits(ref, ids)
    assert expected.std() > 0.1
    assert_close(loaded.model(ids), expected, atol=ATOL, rtol=RTOL, name="mamba_ssm logits")
