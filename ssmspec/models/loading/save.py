"""save_model: write a model directory atomically, in Mamba2ForCausalLM format when it fits, else ssmspec's."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ...errors import InputError
from .common import LoadedModel
from .hf_mamba2 import mamba2_compatible, mamba2_hf_config, mamba2_tensor_name
from .load import WEIGHT_FILES
from .native import NATIVE_MODEL_TYPE, native_config


def write_safetensors(state: dict[str, torch.Tensor], file: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(file), metadata={"format": "pt"})


def save_model(model, out_dir, tokenizer=None) -> str:
    """Write a model directory; returns the format written ("mamba2" or "ssmspec").

    Pure Mamba-2 models go out in transformers' Mamba2ForCausalLM format (config.json +
    model.safetensors) so other tools read them; hybrids go out in ssmspec's native format. The
    directory is written under a temporary name and renamed into place, so an interrupted save
    leaves no half-written model. Into an existing directory, files are replaced one by one
    (other files there are kept; stale weight files are removed).
    """
    if isinstance(model, LoadedModel):
        tokenizer = tokenizer if tokenizer is not None else model.tokenizer
        model = model.model
    out_dir = Path(out_dir)
    fmt, config, state = _format_config_and_state(model)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        write_safetensors(state, tmp / "model.safetensors")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _default_permissions(tmp)
        _move_into_place(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return fmt


def _format_config_and_state(model) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """The format to write, its config.json dict, and the tensors under that format's names."""
    cfg = model.config
    state = dict(model.state_dict())
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; loaders re-tie
    if mamba2_compatible(cfg):
        return "mamba2", mamba2_hf_config(cfg, model.dtype), {mamba2_tensor_name(k): v for k, v in state.items()}
    return NATIVE_MODEL_TYPE, native_config(cfg, model.dtype), state


def _move_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename the finished temporary directory to out_dir, or move its files into an existing one."""
    if not out_dir.exists():
        os.replace(tmp, out_dir)
    elif out_dir.is_dir() and not any(out_dir.iterdir()):
        out_dir.rmdir()
        os.replace(tmp, out_dir)
    elif out_dir.is_dir():
        for stale in out_dir.iterdir():
            if stale.name in WEIGHT_FILES or stale.name.startswith(("model-", "pytorch_model-")):
                stale.unlink()
        # config.json last: a reader never sees a new config with old weights.
        names = sorted(p.name for p in tmp.iterdir())
        names.sort(key=lambda n: n == "config.json")
        for name in names:
            os.replace(tmp / name, out_dir / name)
        tmp.rmdir()
    else:
        raise InputError(f"{out_dir} exists and is not a directory; choose another output path")


def _default_permissions(directory: Path) -> None:
    # mkdtemp makes a 0700 directory; give the result the modes a plain mkdir / open would.
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.rglob("*"):
        f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)
