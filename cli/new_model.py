"""`ssmspec new-model`: write a preset model with random weights to a directory."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ssmspec.errors import InputError

from .app import app


def _vocab_source(path: Path):
    """(tokenizer, vocab size to use) from a tokenizer or model directory."""
    from ssmspec.models.loading import TOKENIZER_FILES, _load_tokenizer

    if not path.is_dir():
        raise InputError(f"--vocab-from {path} is not a directory; pass a tokenizer or model directory")
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        raise InputError(f"--vocab-from {path} holds no tokenizer files ({', '.join(TOKENIZER_FILES)})")
    tokenizer = _load_tokenizer(path)
    vocab = len(tokenizer)
    if (path / "config.json").exists():
        # A model directory: match its (possibly padded) embedding size, so that
        # check_same_vocab accepts the pair.
        import json

        from ssmspec.errors import ModelLoadError
        from ssmspec.models.loading import config_from_dict

        try:
            model_vocab = config_from_dict(json.loads((path / "config.json").read_text()))[0].vocab_size
        except (ModelLoadError, ValueError):
            model_vocab = None
        if model_vocab is not None and model_vocab >= vocab:
            vocab = model_vocab
    return tokenizer, vocab


@app.command("new-model")
def new_model_command(
    preset: str = typer.Option(..., "--preset", help="Preset name: tiny, tiny-hybrid, drafter-2l, mamba2-130m ... mamba2-2.7b, hybrid-8b."),
    out: Path = typer.Option(..., "--out", help="Directory to write (config.json, model.safetensors, tokenizer)."),
    vocab_from: Optional[Path] = typer.Option(None, "--vocab-from", help="Tokenizer or model directory whose vocabulary (and tokenizer) the new model uses."),
    seed: int = typer.Option(0, "--seed", help="Random init seed."),
    dtype: str = typer.Option("fp32", "--dtype", help="Parameter dtype: fp32 or bf16."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Write into a non-empty directory, replacing its model files."),
) -> None:
    """Write a preset model with random weights (pure Mamba-2 in transformers' Mamba2 format, hybrids in ssmspec's).

    Example:
        ssmspec new-model --preset drafter-2l --vocab-from runs/target --out runs/drafter --dtype bf16
    """
    from ssmspec.models.loading import save_model
    from ssmspec.models.presets import PRESETS, build_model, describe_preset

    if preset not in PRESETS:
        raise InputError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if dtype not in ("fp32", "bf16"):
        raise InputError(f"--dtype must be fp32 or bf16, got {dtype!r}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise InputError(f"{out} exists and is not empty; choose a new --out or pass --overwrite")
    tokenizer, vocab = (None, None) if vocab_from is None else _vocab_source(vocab_from)
    model = build_model(preset, vocab_size=vocab, seed=seed, dtype=dtype)
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, key, None)
            if value is not None:
                setattr(model.config, key, int(value))
    fmt = save_model(model, out, tokenizer=tokenizer)
    info = describe_preset(preset, vocab)
    layers = ", ".join(f"{n} {kind}" for kind, n in info["layers"].items())
    fmt_name = "transformers Mamba2ForCausalLM" if fmt == "mamba2" else "ssmspec native"
    typer.echo(
        f"wrote preset {preset}: {info['params']:,} parameters ({layers} layers, d_model {info['d_model']}, "
        f"vocab {model.config.vocab_size}), {dtype}, {fmt_name} format, to {out}"
        + (f" with the tokenizer of {vocab_from}" if tokenizer is not None else "")
    )
