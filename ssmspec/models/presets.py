"""Named model shapes: tiny test models, a 2-layer drafter, the mamba2 family, an ~8B hybrid and
Granite 4.0-H (Mamba-2 + attention + MoE), Falcon-H1 (attention beside Mamba-2) and Zamba2
(shared attention blocks).

Real sizes get random weights (no checkpoint is reachable offline); they exist for timing on
the GPU and as drafters or students to train.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from ..errors import InputError
from .config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig, MoEConfig, SharedBlockConfig
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


def _tiny_moe_hybrid() -> ModelConfig:
    return ModelConfig(
        vocab_size=256, d_model=64, layers=["mamba", "moe", "attention", "moe", "mamba", "moe"],
        mamba=MambaConfig(n_heads=8, head_dim=16, d_state=16, n_groups=2, chunk_size=64),
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, rotary_dim=0),
        moe=MoEConfig(n_experts=8, top_k=2, d_intermediate=32, shared_intermediate=64),
    )


# Granite 4.0-H (GraniteMoeHybridForCausalLM): 40 decoder layers, each a mixer (Mamba-2, or NoPE
# attention at layers 5, 15, 25, 35) and an MoE with a shared expert; Mamba-2 state 128, head dim
# 64, 1 group, conv 4, chunk 256; attention head dim 128 with softmax scale 1/128
# (attention_multiplier); embedding_multiplier 12; tied embeddings; vocabulary 100352; RMSNorm
# eps 1e-5. residual_multiplier (0.22) and logits_scaling, which loading folds into the weights,
# do not change shapes. Sources: ibm-granite/granite-4.0-h-tiny config.json (hidden 1536, 12 / 4
# heads, 48 Mamba heads, 64 experts top 6 of width 512, shared 1024), as quoted in a public
# importer test, and the GGUF metadata of the ollama granite4 builds (h-tiny the same; h-small:
# hidden 4096, 32 / 8 heads, Mamba inner 8192 = 128 heads, 72 experts top 10 of width 768,
# shared 1536).
GRANITE_4_H_ATTENTION = (5, 15, 25, 35)


def _granite_4_h(d_model: int, heads: int, kv_heads: int, experts: int, top_k: int, d_expert: int,
                 d_shared: int) -> Callable[[], ModelConfig]:
    def build() -> ModelConfig:
        layers = []
        for i in range(40):
            layers += ["attention" if i in GRANITE_4_H_ATTENTION else "mamba", "moe"]
        return ModelConfig(
            vocab_size=100352, d_model=d_model, layers=layers,
            mamba=MambaConfig(n_heads=2 * d_model // 64, head_dim=64, d_state=128, n_groups=1, conv_kernel=4,
                              chunk_size=256),
            attention=AttentionConfig(n_heads=heads, n_kv_heads=kv_heads, head_dim=128, rotary_dim=0, scale=1 / 128),
            moe=MoEConfig(n_experts=experts, top_k=top_k, d_intermediate=d_expert, shared_intermediate=d_shared),
            norm_eps=1e-5, embedding_multiplier=12.0, tie_embeddings=True,
            bos_token_id=100257, eos_token_id=100257, pad_token_id=100256,
        )

    return build


def _tiny_parallel_hybrid() -> ModelConfig:
    return ModelConfig(
        vocab_size=256, d_model=64, layers=["mamba", "attention", "mlp"] * 2, parallel_layers=[1, 4],
        mamba=MambaConfig(n_heads=8, head_dim=16, d_state=16, n_groups=2, chunk_size=64),
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=16, rotary_dim=16),
        mlp=MLPConfig(d_intermediate=128, gated=True, activation="silu"),
    )


# Falcon-H1-7B (FalconH1ForCausalLM): 44 decoder layers, each a Mamba-2 mixer with attention beside
# it on the same normed input, then a SwiGLU MLP of width 12288; hidden 3072; attention 12 query /
# 2 KV heads of 128 with RoPE (theta 1e11); Mamba-2 24 heads of 128 (mamba_d_ssm 3072), state 256,
# 1 group, conv 4, chunk 256, gated RMSNorm (mamba_rms_norm true); vocabulary 130049, untied;
# embedding_multiplier 5.657 (the other multipliers are folded into the weights on load and do not
# change shapes). Sources: the size table of transformers' FalconH1 docs
# (huggingface.co/docs/transformers/model_doc/falcon_h1) and the model's config.json values as
# quoted in a public Falcon-H1 loader.
def _falcon_h1_7b() -> ModelConfig:
    return ModelConfig(
        vocab_size=130049, d_model=3072, layers=["mamba", "attention", "mlp"] * 44,
        parallel_layers=[3 * i + 1 for i in range(44)],
        mamba=MambaConfig(n_heads=24, head_dim=128, d_state=256, n_groups=1, conv_kernel=4, chunk_size=256),
        attention=AttentionConfig(n_heads=12, n_kv_heads=2, head_dim=128, rotary_dim=128, rope_theta=1e11),
        mlp=MLPConfig(d_intermediate=12288, gated=True, activation="silu"),
        norm_eps=1e-5, embedding_multiplier=5.656854249492381, tie_embeddings=False,
        bos_token_id=1, eos_token_id=11, pad_token_id=0,
    )


def _tiny_shared_hybrid() -> ModelConfig:
    return ModelConfig(
        vocab_size=256, d_model=64, layers=["mamba", "attention", "mamba", "mamba", "attention", "mamba"],
        mamba=MambaConfig(n_heads=8, head_dim=16, d_state=16, n_groups=2, chunk_size=64),
        attention=AttentionConfig(n_heads=4, n_kv_heads=4, head_dim=32, rotary_dim=32, scale=1 / 4),
        shared_blocks=SharedBlockConfig(n_blocks=1, d_intermediate=128, adapter_rank=8, attention_adapters=True),
        tie_embeddings=True,
    )


# Zamba2-2.7B (Zamba2ForCausalLM): 54 layers of Mamba-2 (80 heads of 64, state 64, 1 group, conv 4,
# chunk 256), 9 of them hybrid (layers 6, 12, 18, 24, 30, 36, 42, 47, 51), each of those a use of
# one of 2 shared blocks (attention over [h | embeddings] of width 5120, 32 heads of 160, and a
# GELU MLP of width 10240) before its Mamba-2 layer; per-use MLP adapters of rank 128 (no
# attention adapters); vocabulary 32000 (Mistral v0.1), tied. Source: Zyphra/Zamba2-2.7B-Instruct-v2
# config.json (huggingface.co). Whether the shared attention uses RoPE does not change shapes.
ZAMBA2_2_7B_HYBRID = (6, 12, 18, 24, 30, 36, 42, 47, 51)


def _zamba2_2_7b() -> ModelConfig:
    layers = []
    for i in range(54):
        layers += ["attention", "mamba"] if i in ZAMBA2_2_7B_HYBRID else ["mamba"]
    return ModelConfig(
        vocab_size=32000, d_model=2560, layers=layers,
        mamba=MambaConfig(n_heads=80, head_dim=64, d_state=64, n_groups=1, conv_kernel=4, chunk_size=256,
                          dt_min=0.001),
        attention=AttentionConfig(n_heads=32, n_kv_heads=32, head_dim=160, rotary_dim=0, scale=80 ** -0.5),
        shared_blocks=SharedBlockConfig(n_blocks=2, d_intermediate=10240, activation="gelu", adapter_rank=128),
        norm_eps=1e-5, tie_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
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
    "tiny-moe-hybrid": _tiny_moe_hybrid,
    "granite-4.0-h-tiny": _granite_4_h(1536, 12, 4, experts=64, top_k=6, d_expert=512, d_shared=1024),
    "granite-4.0-h-small": _granite_4_h(4096, 32, 8, experts=72, top_k=10, d_expert=768, d_shared=1536),
    "tiny-parallel-hybrid": _tiny_parallel_hybrid,
    "falcon-h1-7b": _falcon_h1_7b,
    "tiny-shared-hybrid": _tiny_shared_hybrid,
    "zamba2-2.7b": _zamba2_2_7b,
}

# Presets at real sizes pad a given vocabulary up to a multiple of 16, as mamba_ssm does, so the
# embedding and LM head keep tensor-core friendly shapes; tiny presets keep it exact.
VOCAB_MULTIPLE = {name: (1 if name.startswith("tiny") else 16) for name in PRESETS}


def _pad(n: int, multiple: int) -> int:
    return int(math.ceil(n / multiple) * multiple)


def preset_config(name: str, vocab_size: int | None = None, pad_vocab: bool = True) -> ModelConfig:
    """The ModelConfig of a preset; vocab_size replaces its vocabulary, padded for big presets
    unless pad_vocab is False (a drafter must match its target's embedding size exactly)."""
    if name not in PRESETS:
        raise InputError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    cfg = PRESETS[name]()
    if vocab_size is not None:
        if vocab_size < 1:
            raise InputError(f"vocab_size must be positive, got {vocab_size}")
        cfg.vocab_size = _pad(int(vocab_size), VOCAB_MULTIPLE[name] if pad_vocab else 1)
    return cfg


def describe_preset(name: str, vocab_size: int | None = None, pad_vocab: bool = True) -> dict:
    """Shape summary and parameter count of a preset, computed from the config alone."""
    cfg = preset_config(name, vocab_size, pad_vocab)
    return {
        "preset": name,
        "params": cfg.num_parameters(),
        "d_model": cfg.d_model,
        "layers": {kind: cfg.layers.count(kind) for kind in ("mamba", "attention", "mlp", "moe") if kind in cfg.layers},
        "vocab_size": cfg.vocab_size,
        "pure_mamba": cfg.is_pure_mamba,
    }


@torch.no_grad()
def build_model(
    name: str, *, vocab_size: int | None = None, seed: int = 0, dtype=torch.float32, device="cpu", std: float = 0.02,
    pad_vocab: bool = True,
) -> LanguageModel:
    """A randomly initialised preset model, allocated once, directly on `device` in `dtype`.

    Args:
        name: a key of PRESETS.
        vocab_size: replaces the preset's vocabulary (see preset_config; pad_vocab as there).
        seed: init seed (draws happen on `device`, so CPU and GPU weights differ for one seed).
        dtype: parameter dtype (torch dtype or "fp32" / "bf16").
        std: init scale of linear and embedding weights.
    """
    from .loading import check_fits, empty_model, resolve_dtype

    cfg = preset_config(name, vocab_size, pad_vocab)
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
