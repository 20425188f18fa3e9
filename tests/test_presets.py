"""Presets build and run, real-size presets have their published parameter counts, `ssmspec new-model` works."""
from __future__ import annotations

import pytest
import torch
import typer
from typer.testing import CliRunner

from ssmspec.errors import InputError
from ssmspec.models import LanguageModel
from ssmspec.models.loading import load_model, save_model
from ssmspec.models.presets import PRESETS, build_model, describe_preset, preset_config

SMALL = ("tiny", "tiny-hybrid", "tiny-moe-hybrid", "tiny-parallel-hybrid", "tiny-shared-hybrid", "drafter-2l")
# name -> (low, high) parameter count: the published sizes of the mamba2 family, Nemotron-H-8B
# Granite 4.0-H (Tiny 7B, Small 32.2B), Falcon-H1-7B (7.59B) and Zamba2-2.7B.
EXPECTED_PARAMS = {
    "mamba2-130m": (1.2e8, 1.4e8),
    "mamba2-370m": (3.5e8, 3.9e8),
    "mamba2-780m": (7.5e8, 8.1e8),
    "mamba2-1.3b": (1.25e9, 1.4e9),
    "mamba2-2.7b": (2.6e9, 2.8e9),
    "hybrid-8b": (7.8e9, 8.3e9),
    "granite-4.0-h-tiny": (6.8e9, 7.1e9),
    "granite-4.0-h-small": (3.2e10, 3.25e10),
    "falcon-h1-7b": (7.4e9, 7.7e9),
    "zamba2-2.7b": (2.6e9, 2.8e9),
}


def _unique_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


@pytest.mark.parametrize("name", SMALL)
@torch.no_grad()
def test_small_presets_build_and_run(name):
    model = build_model(name, seed=0)
    cfg = model.config
    assert _unique_params(model) == cfg.num_parameters() == describe_preset(name)["params"]
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert logits.shape == (2, 9, cfg.vocab_size) and torch.isfinite(logits).all()
    cache = model.new_cache(2, max_len=10)
    model(ids, cache)
    assert torch.isfinite(model.step(ids[:, :1], cache)).all()


def test_build_model_seed_and_dtype():
    a, b, c = build_model("tiny", seed=1), build_model("tiny", seed=1), build_model("tiny", seed=2)
    for (name, x), y, z in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(x, y), name
    assert not torch.equal(a.embeddings.weight, c.embeddings.weight)
    half = build_model("tiny-hybrid", dtype="bf16")
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}
    assert torch.equal(half.layers[0].norm.weight, torch.ones_like(half.layers[0].norm.weight))


@pytest.mark.parametrize("name", sorted(EXPECTED_PARAMS))
def test_real_size_parameter_counts(name):
    cfg = preset_config(name)
    low, high = EXPECTED_PARAMS[name]
    assert low <= cfg.num_parameters() <= high
    with torch.device("meta"):  # the module's real shapes, without allocating them
        model = LanguageModel(cfg)
    assert _unique_params(model) == cfg.num_parameters()


def test_preset_shapes():
    cfg = preset_config("mamba2-2.7b")
    assert (cfg.d_model, len(cfg.layers), cfg.mamba.n_heads, cfg.mamba.head_dim, cfg.mamba.d_state) == (2560, 64, 80, 64, 128)
    assert cfg.vocab_size == 50288 and cfg.tie_embeddings
    h = preset_config("hybrid-8b")
    assert len(h.layers) == 52 and h.layers.count("attention") == 4 and h.layers.count("mamba") == 24
    assert (h.mamba.n_groups, h.attention.n_kv_heads, h.mlp.activation, h.vocab_size) == (8, 8, "relu2", 131072)


def test_vocab_override_and_padding():
    assert preset_config("mamba2-130m", vocab_size=50277).vocab_size == 50288
    assert preset_config("drafter-2l", vocab_size=32001).vocab_size == 32016
    assert preset_config("tiny", vocab_size=97).vocab_size == 97
    with pytest.raises(InputError, match="unknown preset"):
        preset_config("mamba3-7b")


# -- the CLI ------------------------------------------------------------------------------------
@pytest.fixture
def cli():
    """A Typer app holding new-model plus a no-op command, so it parses as a command group."""
    from ssmspec.cli.new_model import new_model_command

    app = typer.Typer()
    app.command("new-model")(new_model_command)
    app.command("noop")(lambda: None)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["new-model", *map(str, args)])


def test_new_model_writes_loadable_directory(cli, tmp_path):
    result = cli("--preset", "tiny-hybrid", "--out", tmp_path / "h", "--seed", 3)
    assert result.exit_code == 0, result.output
    assert "tiny-hybrid" in result.output and "179,824" in result.output and "ssmspec native" in result.output
    loaded = load_model(tmp_path / "h")
    expected = build_model("tiny-hybrid", seed=3)
    for name, t in expected.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], t), name

    result = cli("--preset", "tiny", "--out", tmp_path / "m", "--dtype", "bf16")
    assert result.exit_code == 0, result.output
    assert "Mamba2ForCausalLM" in result.output
    loaded = load_model(tmp_path / "m")
    assert loaded.source_format == "mamba2" and loaded.model.dtype == torch.bfloat16


def test_new_model_vocab_from_tokenizer(cli, tmp_path):
    from tests.test_loading import make_tokenizer

    make_tokenizer(40).save_pretrained(tmp_path / "tok")  # 41 tokens
    result = cli("--preset", "drafter-2l", "--out", tmp_path / "d", "--vocab-from", tmp_path / "tok")
    assert result.exit_code == 0, result.output
    loaded = load_model(tmp_path / "d")
    assert loaded.model.config.vocab_size == 48  # 41 padded up to a multiple of 16
    assert loaded.tokenizer is not None and len(loaded.tokenizer) == 41
    assert loaded.model.config.eos_token_id == loaded.tokenizer.eos_token_id


def test_new_model_vocab_from_model_directory_matches_its_vocab(cli, tmp_path):
    from ssmspec.models.loading import check_same_vocab, save_model
    from tests.test_loading import make_tokenizer

    # A target whose embedding (64 rows) is larger than its tokenizer (41 tokens): the drafter
    # copies the 64 (41 padded would give 48), so check_same_vocab accepts the pair.
    save_model(build_model("tiny-hybrid", vocab_size=64), tmp_path / "target", tokenizer=make_tokenizer(40))
    result = cli("--preset", "drafter-2l", "--out", tmp_path / "drafter", "--vocab-from", tmp_path / "target")
    assert result.exit_code == 0, result.output
    drafter = load_model(tmp_path / "drafter")
    assert drafter.model.config.vocab_size == 64
    check_same_vocab(load_model(tmp_path / "target"), drafter)


def test_new_model_vocab_from_a_target_whose_vocab_is_no_multiple_of_16(cli, tmp_path):
    from ssmspec.api import load_drafter
    from tests.test_loading import make_tokenizer

    # A tiny target keeps its tokenizer's 41 tokens exactly; drafter-2l pads a tokenizer's size to
    # a multiple of 16, but from a model directory it takes the target's size as it is (41, not 48).
    save_model(build_model("tiny", vocab_size=41), tmp_path / "target", tokenizer=make_tokenizer(40))
    result = cli("--preset", "drafter-2l", "--out", tmp_path / "drafter", "--vocab-from", tmp_path / "target")
    assert result.exit_code == 0, result.output
    assert "vocab 41" in result.output
    target = load_model(tmp_path / "target")
    assert load_drafter(str(tmp_path / "drafter"), target).model.config.vocab_size == 41


def test_new_model_refuses_non_empty_directory(cli, tmp_path):
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    for extra in ([], ["--overwrite"]):  # files no ssmspec command wrote: --overwrite does not delete them
        result = cli("--preset", "tiny", "--out", out, *extra)
        assert isinstance(result.exception, InputError) and "--overwrite" not in str(result.exception)
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    mine = tmp_path / "m"
    assert cli("--preset", "tiny", "--out", mine).exit_code == 0
    result = cli("--preset", "tiny", "--out", mine)  # its own earlier output: replaced only with --overwrite
    assert isinstance(result.exception, InputError) and "--overwrite" in str(result.exception)
    assert cli("--preset", "tiny", "--out", mine, "--overwrite").exit_code == 0
    assert load_model(mine).source_format == "mamba2"
    bad = cli("--preset", "nope", "--out", tmp_path / "y")
    assert bad.exit_code == 2 and "tiny-hybrid" in bad.output


def test_new_model_help_has_example(cli):
    from ssmspec.cli.new_model import new_model_command

    assert "Example:" in new_model_command.__doc__ and "ssmspec new-model --preset" in new_model_command.__doc__
    assert set(PRESETS) >= {"tiny", "tiny-hybrid", "drafter-2l", "mamba2-130m", "mamba2-2.7b", "hybrid-8b"}


def test_new_model_through_the_ssmspec_entry_point(tmp_path):
    import subprocess
    import sys

    def run(*args):
        cmd = [sys.executable, "-c", "from ssmspec.cli.app import main; main()", "new-model", *map(str, args)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    ok = run("--preset", "tiny", "--out", tmp_path / "m")
    assert ok.returncode == 0, ok.stderr
    assert load_model(tmp_path / "m").source_format == "mamba2"
    refused = run("--preset", "tiny", "--out", tmp_path / "m")
    assert refused.returncode == 2
    assert refused.stderr.strip().startswith("error:") and "--overwrite" in refused.stderr
