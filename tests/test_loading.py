"""save_model / load_model round trips, every load error, check_same_vocab and model fingerprints."""
from __future__ import annotations

import json

import pytest
import torch

from ssmspec.errors import ModelLoadError, TokenizerMismatchError
from ssmspec.models.loading import (
    LoadedModel, check_same_vocab, effective_config_dict, load_model, model_fingerprint, save_model,
)
from tests.helpers import assert_close, tiny_model

transformers = pytest.importorskip("transformers")

HYBRID = ("mamba", "attention", "mlp", "mamba", "mlp")


def make_tokenizer(n_words: int, prefix: str = "w"):
    """A small word-level fast tokenizer built offline (n_words + 1 tokens with [UNK])."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"{prefix}{i}": i for i in range(n_words)}
    vocab["[UNK]"] = n_words
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token=f"{prefix}1")


def _ids(vocab: int, seed: int = 0, shape=(2, 13)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


# -- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_mamba2_saves_in_transformers_format(tmp_path, tie):
    model = tiny_model(("mamba", "mamba", "mamba"), tie_embeddings=tie, eos_token_id=3)
    assert save_model(model, tmp_path / "m") == "mamba2"
    ids = _ids(model.config.vocab_size)
    expected = model(ids)
    assert expected.std() > 0.1
    hf = transformers.Mamba2ForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert_close(hf(input_ids=ids, use_cache=False).logits, expected, name="transformers logits")
    loaded = load_model(tmp_path / "m")
    assert loaded.source_format == "mamba2"
    assert effective_config_dict(loaded.model.config) == effective_config_dict(model.config)
    assert_close(loaded.model(ids), expected, atol=0, rtol=0, name="reloaded logits")
    assert model_fingerprint(loaded) == model_fingerprint(model)
    assert loaded.tokenizer is None


@pytest.mark.parametrize("tie", [False, True])
@torch.no_grad()
def test_hybrid_native_round_trip(tmp_path, tie):
    model = tiny_model(HYBRID, tie_embeddings=tie)
    assert save_model(model, tmp_path / "h") == "ssmspec"
    assert json.loads((tmp_path / "h" / "config.json").read_text())["model_type"] == "ssmspec"
    loaded = load_model(tmp_path / "h")
    assert loaded.source_format == "ssmspec"
    assert loaded.model.config.to_dict() == model.config.to_dict()
    if tie:
        assert loaded.model.lm_head.weight is loaded.model.embeddings.weight
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], t), name
    ids = _ids(model.config.vocab_size)
    assert_close(loaded.model(ids), model(ids), atol=0, rtol=0, name="reloaded hybrid logits")


def test_load_dtype_and_device(tmp_path):
    model = tiny_model(HYBRID)
    save_model(model, tmp_path / "h")
    loaded = load_model(tmp_path / "h", dtype="bf16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert loaded.model.layers[1].mixer.inv_freq.dtype == torch.float32  # RoPE frequencies stay exact
    assert not loaded.model.training


def test_tokenizer_is_saved_and_loaded(tmp_path):
    tok = make_tokenizer(63)
    model = tiny_model(HYBRID, vocab_size=64)
    save_model(model, tmp_path / "t", tokenizer=tok)
    loaded = load_model(tmp_path / "t")
    assert loaded.tokenizer is not None and len(loaded.tokenizer) == 64
    assert loaded.tokenizer.encode("w5 w7") == tok.encode("w5 w7")


@torch.no_grad()
def test_sharded_safetensors_and_bin(tmp_path):
    from safetensors.torch import load_file, save_file

    model = tiny_model(("mamba", "mamba"))
    save_model(model, tmp_path / "a")
    state = load_file(str(tmp_path / "a" / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(sharded / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    torch.save(state, binary / "pytorch_model.bin")
    ids = _ids(model.config.vocab_size)
    for d in (sharded, binary):
        assert_close(load_model(d).model(ids), model(ids), atol=0, rtol=0, name=d.name)


# -- atomic writes ------------------------------------------------------------------------------
def test_interrupted_save_leaves_nothing(tmp_path, monkeypatch):
    import ssmspec.models.loading as loading

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(loading.save, "write_safetensors", boom)
    with pytest.raises(KeyboardInterrupt):
        save_model(tiny_model(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_save_into_existing_directory_replaces_model_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "pytorch_model.bin").write_bytes(b"stale")
    (out / "notes.txt").write_text("kept")
    model = tiny_model(HYBRID)
    save_model(model, out)
    assert not (out / "pytorch_model.bin").exists()
    assert (out / "notes.txt").read_text() == "kept"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt"]
    assert load_model(out).model.config.to_dict() == model.config.to_dict()


# -- errors -------------------------------------------------------------------------------------
def _expect_error(path, *fragments):
    with pytest.raises(ModelLoadError) as info:
        load_model(path)
    msg = str(info.value)
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


def test_error_missing_path(tmp_path):
    _expect_error(tmp_path / "nope", "does not exist")


def test_error_not_a_directory(tmp_path):
    f = tmp_path / "file.bin"
    f.write_bytes(b"x")
    _expect_error(f, "not a directory")


def test_error_no_config(tmp_path):
    _expect_error(tmp_path, "no config.json")


def test_error_malformed_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    _expect_error(tmp_path, "not valid JSON")


def test_error_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))  # llama loads: models/hf_causal.py
    _expect_error(tmp_path, "'t5' is not supported", "mamba2")


def test_error_no_weights(tmp_path):
    save_model(tiny_model(HYBRID), tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    _expect_error(tmp_path / "m", "no weights", "model.safetensors")


def test_error_missing_unexpected_and_misshaped_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    save_model(tiny_model(HYBRID), tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    state = load_file(str(weights))
    missing = dict(state)
    del missing["layers.3.mixer.A_log"]
    save_file(missing, str(weights))
    _expect_error(tmp_path / "m", "missing tensors", "layers.3.mixer.A_log")
    save_file({**state, "layers.9.mixer.extra": torch.zeros(2)}, str(weights))
    _expect_error(tmp_path / "m", "unexpected tensors", "layers.9.mixer.extra")
    save_file({**state, "layers.0.mixer.D": torch.zeros(5)}, str(weights))
    _expect_error(tmp_path / "m", "layers.0.mixer.D", "(5,)")


def test_error_nemotron_moe_with_mlp_bias_refused(tmp_path):
    # MoE blocks load (tests/test_families.py); with biases on their projections they do not
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "nemotron_h", "hybrid_override_pattern": "ME*-", "hidden_size": 16, "mlp_bias": True,
    }))
    _expect_error(tmp_path, "mixture-of-experts")


def test_error_mamba1_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"d_model": 16, "n_layer": 2, "ssm_cfg": {}}))
    _expect_error(tmp_path, "Mamba-2 layers only")


def test_nemotron_legacy_pattern_maps_layers():
    from ssmspec.models.loading import config_from_dict

    cfg, fmt = config_from_dict({
        "model_type": "nemotron_h", "hybrid_override_pattern": "M-*M", "hidden_size": 32,
        "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "attention_head_dim": 8, "mamba_dt_min": 0.02,
    })
    assert fmt == "nemotron_h"
    assert cfg.layers == ["mamba", "mlp", "attention", "mamba"]
    assert cfg.attention.head_dim == 8 and cfg.attention.rotary_dim == 0
    assert cfg.mamba.dt_min == 0.02 and cfg.mamba.dt_max == float("inf")
    assert not cfg.mlp.gated and cfg.mlp.activation == "relu2"


# -- vocabularies and fingerprints -------------------------------------------------------------
def _loaded(model, tokenizer=None):
    return LoadedModel(model=model, tokenizer=tokenizer, source_format="ssmspec", path=None)


def test_check_same_vocab():
    a = _loaded(tiny_model(HYBRID, vocab_size=64), make_tokenizer(63))
    b = _loaded(tiny_model(("mamba",), vocab_size=64), make_tokenizer(63))
    check_same_vocab(a, b)
    check_same_vocab(a.model, b.model)
    with pytest.raises(TokenizerMismatchError, match=r"vocab_size 64 .* has 48"):
        check_same_vocab(a, _loaded(tiny_model(vocab_size=48)))
    with pytest.raises(TokenizerMismatchError, match=r"64 tokens but the drafter's has 61"):
        check_same_vocab(a, _loaded(tiny_model(vocab_size=64), make_tokenizer(60)))
    with pytest.raises(TokenizerMismatchError, match="different vocabularies") as info:
        check_same_vocab(a, _loaded(tiny_model(vocab_size=64), make_tokenizer(63, prefix="v")), "teacher", "student")
    assert "teacher" in str(info.value) and "student" in str(info.value)


def test_model_fingerprint():
    a, b = tiny_model(HYBRID, seed=0), tiny_model(HYBRID, seed=1)
    assert model_fingerprint(a) == model_fingerprint(b)  # shapes and config, not values
    assert model_fingerprint(a) != model_fingerprint(tiny_model(("mamba", "mamba")))
    assert model_fingerprint(a) != model_fingerprint(tiny_model(HYBRID).to(torch.bfloat16))
    assert len(model_fingerprint(a)) == 16


def test_a_model_that_does_not_fit_the_gpu_is_refused_before_allocation(monkeypatch):
    from ssmspec.errors import ModelLoadError
    from ssmspec.models.loading import check_fits
    from ssmspec.models.presets import preset_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (4 * 2**30, 80 * 2**30))
    with pytest.raises(ModelLoadError, match=r"needs 15\.1 GiB .* 4\.0 GiB free"):
        check_fits(preset_config("hybrid-8b"), "cuda", torch.bfloat16)
    check_fits(preset_config("mamba2-130m"), "cuda", torch.bfloat16)  # 0.3 GiB: fits


# -- the package's shape --------------------------------------------------------------------------
PUBLIC_BEFORE_THE_SPLIT = (
    "LoadedModel", "NATIVE_FORMAT_VERSION", "NATIVE_MODEL_TYPE", "Renamer", "TOKENIZER_FILES", "WEIGHT_FILES",
    "check_fits", "check_same_vocab", "config_from_dict", "detect_format", "effective_config_dict", "empty_model",
    "load_model", "mamba2_compatible", "model_fingerprint", "resolve_dtype", "save_model", "vocab_fingerprint",
)


def test_public_names_of_the_single_module_still_import():
    import ssmspec.models.loading as loading

    assert all(hasattr(loading, name) for name in PUBLIC_BEFORE_THE_SPLIT)
    assert set(PUBLIC_BEFORE_THE_SPLIT) <= set(loading.__all__)


def private_imports(package: str) -> list[str]:
    """`from X import _name` statements anywhere in a package's modules (X one of our modules)."""
    import ast
    import importlib
    from pathlib import Path

    root = Path(importlib.import_module(package).__file__).parent
    found = []
    for file in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            ours = isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("ssmspec"))
            if ours:
                found += [f"{file.name}: {a.name}" for a in node.names if a.name.startswith("_") and a.name != "__future__"]
    return found


def test_loading_modules_import_no_private_names():
    assert private_imports("ssmspec.models.loading") == []
