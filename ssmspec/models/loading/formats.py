"""Which format a config.json is, and its mapping onto one ModelConfig and our tensor names."""
from __future__ import annotations

import dataclasses

from ...errors import ModelLoadError
from ..config import ModelConfig
from ..mlp import ACTIVATIONS
from .common import Renamer
from .hf_hybrid import config_bamba, config_falcon_h1, config_granitemoehybrid, config_nemotron_h, config_zamba2
from .hf_mamba2 import config_mamba2
from .mamba_ssm import config_mamba_ssm
from .native import NATIVE_MODEL_TYPE, config_native


def detect_format(cfg: dict) -> str:
    """mamba2, nemotron_h, bamba, granitemoehybrid, falcon_h1, zamba2, mamba_ssm or ssmspec, from a parsed config.json."""
    model_type = cfg.get("model_type")
    if model_type in FORMATS and model_type != "mamba_ssm":
        return model_type
    if model_type is None and {"d_model", "n_layer"} <= cfg.keys():
        return "mamba_ssm"
    known = "mamba2 (Mamba2ForCausalLM), nemotron_h, bamba, granitemoehybrid, falcon_h1, zamba2, mamba_ssm MambaLMHeadModel, ssmspec"
    if model_type is None:
        raise ModelLoadError(f"config.json has no model_type and is not a mamba_ssm config; ssmspec reads {known}")
    raise ModelLoadError(f"model_type {model_type!r} is not supported; ssmspec reads {known}")


# model_type -> the function mapping that format's config.json onto ours.
FORMATS = {
    "mamba2": config_mamba2,
    "nemotron_h": config_nemotron_h,
    "bamba": config_bamba,
    "granitemoehybrid": config_granitemoehybrid,
    "falcon_h1": config_falcon_h1,
    "zamba2": config_zamba2,
    "mamba_ssm": config_mamba_ssm,
    NATIVE_MODEL_TYPE: config_native,
}


def parse_config(cfg: dict) -> tuple[ModelConfig, str, Renamer]:
    """Our ModelConfig, the format name and the tensor renamer for a parsed config.json."""
    fmt = detect_format(cfg)
    try:
        model_cfg, rename = FORMATS[fmt](cfg)
    except ModelLoadError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{fmt} config.json cannot be mapped onto an ssmspec model: {e!r}") from e
    _check_field_types(model_cfg, fmt)
    used = ([model_cfg.mlp.activation] if "mlp" in model_cfg.layers else []) + (
        [model_cfg.moe.activation] if "moe" in model_cfg.layers else []) + (
        [model_cfg.shared_blocks.activation] if model_cfg.shared_blocks is not None else [])
    for activation in used:
        if activation not in ACTIVATIONS:
            raise ModelLoadError(
                f"{fmt} config uses MLP activation {activation!r}; ssmspec implements {', '.join(sorted(ACTIVATIONS))}"
            )
    return model_cfg, fmt, rename


# Size fields that may be 0 (off); every other integer size must be positive.
_MAY_BE_ZERO = {"rotary_dim", "shared_intermediate", "latent_size", "adapter_rank"}


def _check_field_types(cfg: ModelConfig, fmt: str) -> None:
    """Refuse config.json values of the wrong JSON type (a size of 64.0 or "64", a flag of "false").

    The format mappers pass values through as they are; unchecked, a float size failed deep in
    torch with a traceback, a string flag was truthy ("false" tied the embeddings) and a string
    eps failed only at the first forward. Only the sub-configs of layer kinds in use are checked.
    """
    parts = [("", cfg)] + [(f"{kind}.", getattr(cfg, kind)) for kind in ("mamba", "attention", "mlp", "moe")
                           if kind in cfg.layers]
    if cfg.shared_blocks is not None:
        parts.append(("shared_blocks.", cfg.shared_blocks))
    for prefix, part in parts:
        for f in dataclasses.fields(part):
            value = getattr(part, f.name)
            if f.type == "int":
                ok = isinstance(value, int) and not isinstance(value, bool) and (
                    value > 0 or (value == 0 and f.name in _MAY_BE_ZERO))
                expected = "a non-negative integer" if f.name in _MAY_BE_ZERO else "a positive integer"
            elif f.type in ("float", "float | None"):
                ok = (value is None and f.type != "float") or (
                    isinstance(value, (int, float)) and not isinstance(value, bool))
                expected = "a number"
            elif f.type == "bool":
                ok = isinstance(value, bool) or (type(value) is int and value in (0, 1))
                expected = "true or false"
            elif f.type == "int | None":  # token ids
                ok = value is None or (isinstance(value, int) and not isinstance(value, bool))
                expected = "an integer token id or null"
            else:
                continue
            if not ok:
                raise ModelLoadError(
                    f"{fmt} config.json gives the model's {prefix}{f.name} the value {value!r}, which is not "
                    f"{expected}; fix that field of config.json"
                )


def config_from_dict(cfg: dict) -> tuple[ModelConfig, str]:
    """Our ModelConfig and the format name for a parsed config.json of any supported format."""
    model_cfg, fmt, _ = parse_config(cfg)
    return model_cfg, fmt
