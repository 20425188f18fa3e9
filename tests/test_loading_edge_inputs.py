"""Model and tokenizer loading, edge inputs (a bug hunt): config.json fields of the wrong type, a tied
config over a checkpoint with its own head, weight files that hold no state dict, transformers
checkpoints with missing weights, dangling symbolic links, a tokenizer larger than the model's
vocabulary, weights larger than host memory, and new-model --vocab-from a transformers target."""
from __future__ import annotations

import json

import pytest
import torch

from ssmspec.errors import ModelLoadError
from ssmspec.models.loading import load_model, save_model
from tests.helpers import assert_close, tiny_model

transformers = pytest.importorskip("transformers")


def _edit_config(directory, **changes):
    file = directory / "config.json"
    cfg = json.loads(file.read_text())
    cfg.update(changes)
    file.write_text(json.dumps(cfg))


@pytest.fixture
def mamba2_dir(tmp_path):
    """An untied pure Mamba-2 model saved in transformers' Mamba2ForCausalLM format, and the model."""
    model = tiny_model(("mamba", "mamba"))
    save_model(model, tmp_path / "m")
    return tmp_path / "m", model


# -- config.json fields of the wrong JSON type ----------------------------------------------------
@pytest.mark.parametrize("key, value, named", [
    ("hidden_size", 32.0, "d_model"),  # was torch's TypeError from empty()
    ("vocab_size", None, "vocab_size"),  # same
    ("tie_word_embeddings", "false", "tie_embeddings"),  # a truthy string: it loaded tied
    ("layer_norm_epsilon", "1e-5", "norm_eps"),  # loaded, then failed at the first forward
    ("chunk_size", 0, "mamba.chunk_size"),  # loaded, then ZeroDivisionError at the first forward
    ("eos_token_id", "</s>", "eos_token_id"),  # loaded: generation would never stop at it
])
def test_config_fields_of_the_wrong_type_are_refused_naming_the_field(mamba2_dir, key, value, named):
    path, model = mamba2_dir
    assert model.config.d_model == 32
    _edit_config(path, **{key: value})
    with pytest.raises(ModelLoadError, match=rf"config\.json gives the model's {named} the value {value!r}"):
        load_model(path)


def test_native_config_fields_of_the_wrong_type_are_refused(tmp_path):
    save_model(tiny_model(("mamba", "attention", "mlp")), tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    cfg["ssmspec"]["attention"]["head_dim"] = "16"
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="attention.head_dim the value '16'"):
        load_model(tmp_path / "h")


# -- tied embeddings ------------------------------------------------------------------------------
@torch.no_grad()
def test_a_tied_config_over_a_checkpoint_with_its_own_head_keeps_both(mamba2_dir):
    # transformers keeps both tensors (and warns); ssmspec tied them and loaded the head over the
    # embeddings, so the model's input embeddings were silently the LM head's rows.
    path, model = mamba2_dir
    _edit_config(path, tie_word_embeddings=True)
    with pytest.warns(UserWarning, match="differs"):
        loaded = load_model(path).model
    assert torch.equal(loaded.embeddings.weight, model.embeddings.weight)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    assert_close(loaded(ids), model(ids), atol=0, rtol=0, name="logits")


# -- weight files ---------------------------------------------------------------------------------
def test_weight_files_without_a_state_dict_are_one_error(mamba2_dir):
    from safetensors.torch import load_file

    path, _ = mamba2_dir
    state = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    for content, fragment in (({"model": state}, "its entry 'model' is a dict"), ([1, 2], "holds a list")):
        torch.save(content, path / "pytorch_model.bin")  # was AttributeError: no is_floating_point / items
        with pytest.raises(ModelLoadError, match=fragment):
            load_model(path)
    (path / "pytorch_model.bin").unlink()
    for weight_map in (["model.safetensors"], {"lm_head.weight": 3}):  # was AttributeError / TypeError
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(ModelLoadError, match="weight_map must map tensor names to shard file names"):
            load_model(path)


def test_a_transformers_checkpoint_missing_weights_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    file = tmp_path / "llama" / "model.safetensors"
    state = load_file(str(file))
    del state["model.norm.weight"]
    save_file(state, str(file), metadata={"format": "pt"})
    # transformers initialised the missing norm at random and only warned: a half-random target
    with pytest.raises(ModelLoadError, match=r"missing tensors model\.norm\.weight"):
        load_model(tmp_path / "llama")


@pytest.mark.parametrize("name", ["config.json", "model.safetensors", "tokenizer.json"])
def test_a_dangling_symbolic_link_is_named(mamba2_dir, name):
    # A Hugging Face cache snapshot copied with `cp -r`: its files link to blobs that are not there.
    # config.json and the weights were said to be missing; a tokenizer was skipped (bytes instead).
    path, _ = mamba2_dir
    (path / name).unlink(missing_ok=True)
    (path / name).symlink_to(path.parent / "blobs" / "0a1b2c")
    with pytest.raises(ModelLoadError, match=rf"{name} is a symbolic link to .*0a1b2c, which does not exist"):
        load_model(path)


# -- tokenizers -----------------------------------------------------------------------------------
def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    from tests.test_loading import make_tokenizer

    # 100 tokens for a 64-row embedding: prompts failed with "index out of range in self"
    save_model(tiny_model(), tmp_path / "m", tokenizer=make_tokenizer(99))
    with pytest.raises(ModelLoadError, match="has 100 tokens but the model's vocabulary .* has 64"):
        load_model(tmp_path / "m")
    # special tokens added past the embedding are not produced by text: still accepted
    tok = make_tokenizer(63)
    tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    save_model(tiny_model(), tmp_path / "m", tokenizer=tok)
    assert len(load_model(tmp_path / "m").tokenizer) == 65


# -- host memory ----------------------------------------------------------------------------------
def test_weights_larger_than_host_memory_are_refused_before_allocation(monkeypatch):
    import ssmspec.limits as limits
    from ssmspec.models.loading import check_fits
    from ssmspec.models.presets import build_model, preset_config

    # Linux overcommits: the allocation succeeded and the process was killed while writing weights.
    monkeypatch.setattr(limits, "available_bytes", lambda device: (2 * 2**30, "the machine has"))
    with pytest.raises(ModelLoadError, match=r"needs 5\.0 GiB .* the machine has 2\.0 GiB available"):
        check_fits(preset_config("mamba2-1.3b"), "cpu", torch.float32)
    with pytest.raises(ModelLoadError, match=r"needs 30\.2 GiB"):
        build_model("hybrid-8b")
    check_fits(preset_config("mamba2-130m"), "cpu", torch.float32)  # 0.5 GiB: fits


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_the_host_memory_check_sees_a_container_limit(tmp_path, monkeypatch, version):
    import ssmspec.limits as limits

    gib = 2**30
    # v1 (Docker on older hosts) was not read: the check saw the whole host's MemAvailable. Read
    # weights files stay in the group's page cache, counted as usage though the kernel reclaims it.
    limit, usage, stat = (tmp_path / name for name in ("limit", "usage", "stat"))
    limit.write_text(f"{8 * gib}\n")
    usage.write_text(f"{6 * gib}\n")
    key = "total_inactive_file" if version == "v1" else "inactive_file"
    stat.write_text(f"cache 5\n{key} {gib}\nother 7\n")
    files = (str(limit), str(usage), str(stat), key)
    missing = (str(tmp_path / "none"),) * 3 + ("inactive_file",)
    monkeypatch.setattr(limits, "CGROUP_MEMORY_FILES", (missing, files) if version == "v1" else (files, missing))
    monkeypatch.setattr(limits, "_meminfo_available", lambda: 20 * gib)
    assert limits.available_bytes("cpu") == (3 * gib, "the memory limit of this container leaves")
    limit.write_text("max\n" if version == "v2" else "9223372036854771712\n")  # no limit
    assert limits.available_bytes("cpu") == (20 * gib, "the machine has")


# -- new-model --vocab-from -----------------------------------------------------------------------
def test_new_model_vocab_from_a_transformers_target_without_a_tokenizer(tmp_path):
    from typer.testing import CliRunner

    from ssmspec.cli.app import app

    # A Llama target (ssmspec runs those too) has a vocab_size, though no SSM format of ours: it
    # was refused as naming "no vocabulary size".
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 300}))
    result = CliRunner().invoke(app, ["new-model", "--preset", "tiny", "--out", str(tmp_path / "d"),
                                      "--vocab-from", str(tmp_path / "llama")])
    assert result.exit_code == 0, result.output
    assert load_model(tmp_path / "d").model.config.vocab_size == 300
