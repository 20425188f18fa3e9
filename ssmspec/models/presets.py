"""Named model shapes: tiny test models, a 2-layer drafter, the mamba2 family and an ~8B hybrid.

Real sizes get random weights (no checkpoint is reachable offline); they exist for timing on
the GPU and as drafters or students to train.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import InputError
from .config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig
from .init import init_weights
from .lm import LanguageModel

GPT_NEOX_VOCAB = 50277
"""The mamba2 family's tokenizer (GPT-NeoX); its checkpoints pad the embedding to 50288."""


def _mamba2_family(d_model: int, n_layer: int) -> Callable[[], ModelConfig]:
    # state-spaces/mamba2-* (mamba_ssm): d_state 128, head dim 64, expand 2, 1 group, conv 4,
    # chunk 256, tied embeddings, vocabulary 50277 padded to a multiple of 16 (RESOURCES.md).
    def build() -> ModelConfig:
        return ModelConfig(
            vocab_size=_pad(GPT_NEOX_VOCAB, 16), d_model=d_model, layers=["mamba"] * n_layer,
            mamba=MambaConfig(n_heads=2 * d_model // 64, head_dim=64, d_state=128, n_groups=1, conv_kernel=4, chunk_size=256),
            norm_eps=1e-5, tie_embeddings=True, bos_token_id=0, eos_token_id=0,
        )

    return build


def _tiny() -> ModelConfig:
    return ModelConfig(
        vocab_size=256, d_model=64, layers=["mamba"] * 2,
        mamba=MambaConfig(n_heads=8, head_dim=16, d_state=16, n_groups=1, chunk_size=64),
    )


def _tiny_hybrid() -> ModelConfig:
    return ModelConfig(
        vocab_size=256, d_model=64, layers=["mamba", "mlp", "attention", "mlp", "mamba", "mlp"],
        mamba=MambaConfig(n_heads=8, head_dim=16, d_state=16, n_groups=2, chunk_size=64),
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, rotary_dim=8),
        mlp=MLPConfig(d_intermediate=128, gated=True, activation="silu"),
    )


def _drafter_2l() -> ModelConfig:
    # A 2-layer Mamba-2 drafter; the vocabulary defaults to the mamba2 family's and is normally
    # replaced by the target's (preset_config(..., vocab_size=target vocab)).
    return ModelConfig(
        vocab_size=_pad(GPT_NEOX_VOCAB, 16), d_model=256, layers=["mamba"] * 2,
        mamba=MambaConfig(n_heads=8, head_dim=64, d_state=64, n_groups=1, chunk_size=64),
        tie_embeddings=True, bos_token_id=0, eos_token_id=0,
    )


# Nemotron-H-8B-Base-8K (nvidia/Nemotron-H-8B-Base-8K config.json, as quoted in NVIDIA's
# Megatron-Bridge model docs, docs.nvidia.com/nemo/megatron-bridge/latest/models/llm/nemotronh.html):
# hidden 4096, 52 layers "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-" (24 Mamba-2,
# 4 attention, 24 MLP), Mamba 128 heads x 64, state 128, 8 groups, conv 4, chunk 128; attention
# 32 query / 8 KV heads x 128 without RoPE; MLP 21504 squared-ReLU (not gated); vocab 131072,
# untied; RMSNorm eps 1e-5; time step clamped below at time_step_min 0.001.
NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp"}


def _hybrid_8b() -> ModelConfig:
    return ModelConfig(
        vocab_size=131072, d_model=4096, layers=[_PATTERN_KINDS[c] for c in NEMOTRON_H_8B_PATTERN],
        mamba=MambaConfig(n_heads=128, head_dim=64, d_state=128, n_groups=8, conv_kernel=4, chunk_size=128, dt_min=0.001),
        attention=AttentionConfig(n_heads=32, n_kv_heads=8, head_dim=128, rotary_dim=0),
        mlp=MLPConfig(d_intermediate=21504, gated=False, activation="relu2"),
        norm_eps=1e-5, tie_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny": _tiny,
    "tiny-hybrid": _tiny_hybrid,
    "drafter-2l": _drafter_2l,
    "mamba2-130m": _mamba2_family(768, 24),
    "mamba2-370m": _mamba2_family(1024, 48),
    "mamba2-780m": _mamba2_family(1536, 48),
    "mamba2-1.3b": _mamba2_family(2048, 48),
    "mamba2-2.7b": _mamba2_family(2560, 64),
    "hybrid-8b": _hybrid_8b,
}

# Presets at real sizes pad a given vocabulary up to a multiple of 16, as mamba_ssm does, so the
# embedding and LM head keep tensor-core friendly shapes; tiny presets keep it exact.
VOCAB_MULTIPLE = {name: (1 if name.startswith("tiny") else 16) for name in PRESETS}


def _pad(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple)


def preset_config(name: str, vocab_size: int | None = None) -> ModelConfig:
    """The ModelConfig of a preset; vocab_size replaces its vocabulary (padded for big presets)."""
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[name]()
    if vocab_size is not None:
        if vocab_size < 1:
            raise InputError(f"vocab_size must be positive, got {vocab_size}")
        cfg.vocab_size = _pad(int(vocab_size), VOCAB_MULTIPLE[name])
    return cfg


def describe_preset(name: str, vocab_size: int | None = None) -> dict:
    """Shape summary and parameter count of a preset, computed from the config alone."""
    cfg = preset_config(name, vocab_size)
    return {
        "preset": name,
        "params": cfg.num_parameters(),
        "d_model": cfg.d_model,
        "layers": {kind: cfg.layers.count(kind) for kind in ("mamba", "attention", "mlp") if kind in cfg.layers},
        "vocab_size": cfg.vocab_size,
        "pure_mamba": cfg.is_pure_mamba,
    }


@torch.no_grad()
def build_model(
    name: str, *, vocab_size: int | None = None, seed: int = 0, dtype=torch.float32, device="cpu", std: float = 0.02
) -> LanguageModel:
    """A randomly initialised preset model, allocated once, directly on `device` in `dtype`.

    Args:
        name: a key of PRESETS.
        vocab_size: replaces the preset's vocabulary (see preset_config).
        seed: init seed (draws happen on `device`, so CPU and GPU weights differ for one seed).
        dtype: parameter dtype (torch dtype or "fp32" / "bf16").
        std: init scale of linear and embedding weights.
    """
    from .loading import check_fits, empty_model, resolve_dtype

    cfg = preset_config(name, vocab_size)
    check_fits(cfg, device, resolve_dtype(dtype) or torch.float32)
    model = empty_model(cfg, device=device, dtype=resolve_dtype(dtype) or torch.float32)
    # Storage is uninitialised: poison it, set what init_weights leaves alone (norm gains), init,
    # then check that nothing was left behind.
    for p in model.parameters():
        p.fill_(float("nan"))
    for module_name, p in model.named_parameters():
        if module_name.endswith("norm.weight") or module_name == "norm_f.weight":
            p.fill_(1.0)
    init_weights(model, seed=seed, std=std)
    for module_name, p in model.named_parameters():
        if not torch.isfinite(p).all():
            raise RuntimeError(f"build_model left {module_name} uninitialised; init_weights must cover it")
    return model.eval()
