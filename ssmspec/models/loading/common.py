"""What every format's loader shares: the loaded-model record, dtype names, config-field readers, renamers."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ...errors import InputError, ModelLoadError
from ..lm import LanguageModel


_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
}


@dataclass
class LoadedModel:
    """A model read from disk, with its tokenizer when the directory has one."""

    model: LanguageModel
    tokenizer: Any | None
    source_format: str
    """One of mamba2, nemotron_h, bamba, granitemoehybrid, falcon_h1, zamba2, mamba_ssm, ssmspec."""
    path: Path


def resolve_dtype(dtype) -> torch.dtype | None:
    """None, a torch dtype, or a name such as "bf16" / "float32"."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    return _DTYPES[key]


def dt_limit(value) -> tuple[float, float]:
    """transformers / mamba_ssm time_step_limit ([lo, hi], hi may be inf or null) -> (lo, hi)."""
    if value is None:
        return 0.0, math.inf
    lo, hi = (_json_float(v) for v in value)
    return float(lo if lo is not None else 0.0), math.inf if hi is None else float(hi)


def _json_float(v):
    """transformers 5 writes inf into config.json as {"__float__": "Infinity"}."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return v


def _one_token_id(value):
    # Some configs list several eos ids; our config keeps one (the first).
    if isinstance(value, (list, tuple)):
        return int(value[0]) if value else None
    return value


def special_ids(cfg: dict, defaults: tuple) -> dict:
    """bos / eos / pad ids from a config.json, with the format's (bos, eos, pad) defaults."""
    bos, eos, pad = defaults
    return {
        "bos_token_id": _one_token_id(cfg.get("bos_token_id", bos)),
        "eos_token_id": _one_token_id(cfg.get("eos_token_id", eos)),
        "pad_token_id": _one_token_id(cfg.get("pad_token_id", pad)),
    }


GENERATION_CONFIG = "generation_config.json"


def declared_eos_ids(model_dir: str | Path | None) -> list[int]:
    """The ids a checkpoint's generation_config.json says end a generation, or [] where it names
    none. transformers stops at any of them (Llama 3 and Qwen 2.5 chat models list several, and
    the tokenizer's EOS is only one), so a generation here stops where theirs does."""
    if model_dir is None:
        return []
    try:
        value = json.loads((Path(model_dir) / GENERATION_CONFIG).read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):  # no file, not JSON, not an object
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def few_names(keys: list[str], limit: int = 6) -> str:
    """The first `limit` names, and how many more (for error messages)."""
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_not_dangling(file: Path) -> None:
    """Refuse a symbolic link to nothing, which reads as a missing file.

    A Hugging Face cache snapshot is links into ../../blobs; copied with `cp -r` they dangle, and
    the directory was said to have no config.json or no weights while `ls` showed them.
    """
    if file.is_symlink() and not file.exists():
        raise ModelLoadError(f"{file} is a symbolic link to {os.readlink(file)}, which does not exist; "
                             "copy the model with its link targets (cp -rL)")


def require_silu(cfg: dict, key: str, fmt: str) -> None:
    """Refuse a Mamba mixer activation other than silu (the only one our mixer implements)."""
    act = cfg.get(key, "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{fmt} config has {key}={act!r}; ssmspec's Mamba-2 mixer only implements silu")


# One source tensor -> zero or more (our name, tensor) pairs; a format's mapping onto
# LanguageModel.state_dict() names.
Renamer = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


def prefix_renamer(mapping: Callable[[str], str | None]) -> Renamer:
    """A Renamer from a one-to-one name mapping (None drops the tensor)."""
    def rename(name, tensor):
        new = mapping(name)
        return [] if new is None else [(new, tensor)]

    return rename
