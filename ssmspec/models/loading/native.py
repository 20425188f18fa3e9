"""ssmspec's own format: config.json holds ModelConfig.to_dict() under "ssmspec"; tensor names are ours."""
from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..config import ModelConfig
from .common import Renamer, prefix_renamer


NATIVE_MODEL_TYPE = "ssmspec"
NATIVE_FORMAT_VERSION = 1


def config_native(c: dict) -> tuple[ModelConfig, Renamer]:
    """Our own config.json section; tensor names are already ours."""
    body = c.get(NATIVE_MODEL_TYPE)
    if not isinstance(body, dict):
        raise ModelLoadError(f"ssmspec config.json lacks its {NATIVE_MODEL_TYPE!r} section; regenerate it with save_model")
    try:
        cfg = ModelConfig.from_dict(body)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"ssmspec config.json section is invalid: {e}") from e
    return cfg, prefix_renamer(lambda n: n)


def native_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of ssmspec's format for a model of this config and parameter dtype."""
    return {
        "model_type": NATIVE_MODEL_TYPE, "format_version": NATIVE_FORMAT_VERSION,
        "dtype": str(dtype).removeprefix("torch."), NATIVE_MODEL_TYPE: cfg.to_dict(),
    }
