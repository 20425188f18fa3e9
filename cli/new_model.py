"""`ssmspec new-model`: write a preset model with random weights to a directory."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ssmspec.errors import InputError
from ssmspec.models.presets import PRESETS

from . import options, outputs


def _vocab_source(path: Path):
    """(tokenizer or None, vocab size to use, whether to use it unpadded) from a tokenizer or model directory."""
    from ssmspec.models.loading import TOKENIZER_FILES, load_tokenizer

    if not path.is_dir():
        raise InputError(f"--vocab-from {path} is not a directory; pass a tokenizer or model directory")
    tokenizer = load_tokenizer(path)  # None without tokenizer files
    if tokenizer is None and not (path / "config.json").exists():
        raise InputError(f"--vocab-from {path} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}) and no model")
    # A model without a tokenizer (a byte-vocabulary target from new-model) still has a vocabulary.
    vocab, exact = (len(tokenizer) if tokenizer is not None else 0), False
    if (path / "config.json").exists():
        # A model directory: match its (possibly padded) embedding size exactly, without the
        # preset's own padding, so that check_same_vocab accepts the pair.
        import json

        from ssmspec.errors import ModelLoadError
        from ssmspec.models.loading import config_from_dict

        raw = None
        try:
            raw = json.loads((path / "config.json").read_text())
            model_vocab = config_from_dict(raw)[0].vocab_size
        except (ModelLoadError, ValueError):
            # Not an SSM format (a transformers Llama or Qwen2 target, which ssmspec also runs):
            # its vocab_size field is still the embedding size a drafter must match.
            model_vocab = raw.get("vocab_size") if isinstance(raw, dict) else None
        if isinstance(model_vocab, int) and not isinstance(model_vocab, bool) and model_vocab >= vocab:
            vocab, exact = model_vocab, True
    if not vocab:
        raise InputError(f"--vocab-from {path} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}) and its "
                         "config.json names no vocabulary size")
    return tokenizer, vocab, exact


def new_model_command(
    preset: str = options.choice(..., "--preset", choices=tuple(PRESETS), help="Preset."),
    out: Path = typer.Option(..., "--out", help="Directory to write (config.json, model.safetensors, tokenizer)."),
    vocab_from: Optional[Path] = typer.Option(None, "--vocab-from", exists=True, file_okay=False,
                                              help="Tokenizer or model directory whose vocabulary (and tokenizer) the new model uses."),
    seed: int = options.count(0, "--seed", help="Random init seed."),
    dtype: str = options.choice("fp32", "--dtype", choices=("fp32", "bf16"), help="Parameter dtype."),
    overwrite: bool = options.flag(False, "--overwrite", help="Replace an earlier `ssmspec new-model` output in --out."),
) -> None:
    """Write a preset model with random weights (pure Mamba-2 in transformers' Mamba2 format, hybrids in ssmspec's).

    Example:
        ssmspec new-model --preset drafter-2l --vocab-from runs/target --out runs/drafter --dtype bf16
    """
    from ssmspec.models.loading import save_model
    from ssmspec.models.presets import build_model, describe_preset

    outputs.claim(out, "new-model", inputs={"--vocab-from": vocab_from}, overwrite=overwrite)
    tokenizer, vocab, exact = (None, None, False) if vocab_from is None else _vocab_source(vocab_from)
    model = build_model(preset, vocab_size=vocab, seed=seed, dtype=dtype, pad_vocab=not exact)
    if tokenizer is not None:
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(tokenizer, key, None)
            if value is not None:
                setattr(model.config, key, int(value))
    fmt = save_model(model, out, tokenizer=tokenizer)
    outputs.mark(out, "new-model")
    info = describe_preset(preset, vocab, pad_vocab=not exact)
    layers = ", ".join(f"{n} {kind}" for kind, n in info["layers"].items())
    fmt_name = "transformers Mamba2ForCausalLM" if fmt == "mamba2" else "ssmspec native"
    typer.echo(
        f"wrote preset {preset}: {info['params']:,} parameters ({layers} layers, d_model {info['d_model']}, "
        f"vocab {model.config.vocab_size}), {dtype}, {fmt_name} format, to {out}"
        + (f" with the tokenizer of {vocab_from}" if tokenizer is not None
           else f" with the vocabulary of {vocab_from}" if vocab_from is not None else "")
    )
