"""Read and write model directories: transformers Mamba2 / NemotronH / Bamba, mamba_ssm, and ssmspec's own format.

Every format is mapped onto one `ModelConfig` and onto `LanguageModel.state_dict()` names, then
loaded strictly: a missing or unexpected tensor, or a shape mismatch, is a `ModelLoadError` that
names it, never a silently half-random model.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import InputError, ModelLoadError, TokenizerMismatchError
from .config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig
from .lm import LanguageModel

NATIVE_MODEL_TYPE = "ssmspec"
NATIVE_FORMAT_VERSION = 1
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# Weight files in the order we look for them (transformers' own preference: safetensors first).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")

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
    """One of mamba2, nemotron_h, bamba, mamba_ssm, ssmspec."""
    path: Path


# -----------------------------------------------------------------------------------------------
# small helpers
# -----------------------------------------------------------------------------------------------
def resolve_dtype(dtype) -> torch.dtype | None:
    """None, a torch dtype, or a name such as "bf16" / "float32"."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise InputError(f"unknown dtype {dtype!r}; use one of fp32, bf16, fp16")
    return _DTYPES[key]


def _dt_limit(value) -> tuple[float, float]:
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


def _special_ids(cfg: dict, defaults: tuple) -> dict:
    bos, eos, pad = defaults
    return {
        "bos_token_id": _one_token_id(cfg.get("bos_token_id", bos)),
        "eos_token_id": _one_token_id(cfg.get("eos_token_id", eos)),
        "pad_token_id": _one_token_id(cfg.get("pad_token_id", pad)),
    }


def _require_silu(cfg: dict, key: str, fmt: str) -> None:
    act = cfg.get(key, "silu")
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"{fmt} config has {key}={act!r}; ssmspec's Mamba-2 mixer only implements silu")


def check_fits(cfg: ModelConfig, device, dtype: torch.dtype) -> None:
    """Refuse, before allocating, a model whose weights alone exceed the GPU's free memory."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return
    needed = cfg.num_parameters() * torch.empty((), dtype=dtype).element_size()
    free, total = torch.cuda.mem_get_info(device)
    if needed > free:
        gib = 2**30
        raise ModelLoadError(
            f"the model needs {needed / gib:.1f} GiB for its weights in {str(dtype).removeprefix('torch.')} but "
            f"{device} has {free / gib:.1f} GiB free of {total / gib:.1f} GiB; use --dtype bf16, a smaller model, "
            "or a GPU with more memory"
        )


def empty_model(cfg: ModelConfig, device="cpu", dtype: torch.dtype = torch.float32) -> LanguageModel:
    """A LanguageModel with uninitialised storage on `device` (no wasted init, no CPU detour).

    Built on the meta device, then given real (empty) storage; the caller must overwrite every
    parameter (loading or init_weights). Non-persistent buffers (RoPE frequencies) are rebuilt
    here, in fp32, because `to_empty` leaves them as garbage.
    """
    with torch.device("meta"):
        model = LanguageModel(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embeddings.weight  # to_empty makes new tensors, so tie again
    _rebuild_nonpersistent_buffers(model, device)
    return model


def _rebuild_nonpersistent_buffers(model: LanguageModel, device) -> None:
    from .attention import Attention

    reference = None
    for module in model.modules():
        names = getattr(module, "_non_persistent_buffers_set", set())
        if not names:
            continue
        if not isinstance(module, Attention):
            raise RuntimeError(f"don't know how to rebuild buffers {sorted(names)} of {type(module).__name__}")
        if reference is None:
            # A throwaway attention layer on the CPU computes the buffers exactly as the module does.
            with torch.device("cpu"):
                reference = Attention(model.config.d_model, model.config.attention)
        for name in names:
            module._buffers[name] = getattr(reference, name).to(device)


# -----------------------------------------------------------------------------------------------
# reading a directory
# -----------------------------------------------------------------------------------------------
def _read_config(path: Path) -> dict:
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist; pass a directory holding config.json and weights")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory; pass the directory that holds config.json")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise ModelLoadError(
            f"{path} has no config.json; a model directory needs config.json and weights "
            "(create one with `ssmspec new-model` or `save_pretrained`)"
        )
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON ({e}); fix or regenerate the file") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file} must hold a JSON object, not {type(cfg).__name__}")
    return cfg


def detect_format(cfg: dict) -> str:
    """mamba2, nemotron_h, bamba, mamba_ssm or ssmspec, from a parsed config.json."""
    model_type = cfg.get("model_type")
    if model_type in ("mamba2", "nemotron_h", "bamba", NATIVE_MODEL_TYPE):
        return model_type
    if model_type is None and {"d_model", "n_layer"} <= cfg.keys():
        return "mamba_ssm"
    known = "mamba2 (Mamba2ForCausalLM), nemotron_h, bamba, mamba_ssm MambaLMHeadModel, ssmspec"
    if model_type is None:
        raise ModelLoadError(f"config.json has no model_type and is not a mamba_ssm config; ssmspec reads {known}")
    raise ModelLoadError(f"model_type {model_type!r} is not supported; ssmspec reads {known}")


def _load_tensor_file(file: Path) -> dict[str, torch.Tensor]:
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            return load_file(str(file), device="cpu")
        return torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: say which one
        raise ModelLoadError(f"cannot read weights file {file}: {e}") from e


def _read_weights(path: Path) -> tuple[dict[str, torch.Tensor], str]:
    for name in WEIGHT_FILES:
        file = path / name
        if not file.exists():
            continue
        if name.endswith(".index.json"):
            try:
                index = json.loads(file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ModelLoadError(f"{file} is not a valid shard index (needs a weight_map): {e}") from e
            state = {}
            for shard in sorted(set(index.values())):
                if not (path / shard).exists():
                    raise ModelLoadError(f"{file} lists shard {shard}, which is missing from {path}")
                state.update(_load_tensor_file(path / shard))
            return state, name
        return _load_tensor_file(file), name
    raise ModelLoadError(
        f"{path} has config.json but no weights; expected one of {', '.join(WEIGHT_FILES)}"
    )


def _load_tokenizer(path: Path):
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        # AutoTokenizer reads config.json too and warns about model types it does not know
        # (ssmspec's own format): noise for the user, so keep transformers quiet here.
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        try:
            return AutoTokenizer.from_pretrained(str(path))
        finally:
            hf_logging.set_verbosity(verbosity)
    except Exception as e:
        raise ModelLoadError(f"{path} has tokenizer files but they do not load ({e}); remove or fix them") from e


# -----------------------------------------------------------------------------------------------
# config mapping, one function per format: (ModelConfig, rename(source_name) -> our names)
# Defaults are those of the transformers / mamba_ssm config classes, so a config.json that omits
# a field means what it means there.
# -----------------------------------------------------------------------------------------------
Renamer = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


def _prefix_renamer(mapping: Callable[[str], str | None]) -> Renamer:
    def rename(name, tensor):
        new = mapping(name)
        return [] if new is None else [(new, tensor)]

    return rename


def _config_mamba2(c: dict) -> tuple[ModelConfig, Renamer]:
    fmt = "Mamba2"
    _require_silu(c, "hidden_act", fmt)
    hidden = c.get("hidden_size", 4096)
    heads, head_dim = c.get("num_heads", 128), c.get("head_dim", 64)
    expand = c.get("expand", 2)
    if int(expand * hidden) != heads * head_dim:
        raise ModelLoadError(
            f"{fmt} config is inconsistent: expand * hidden_size = {int(expand * hidden)} but "
            f"num_heads * head_dim = {heads * head_dim}"
        )
    lo, hi = _dt_limit(c.get("time_step_limit"))
    eps = c.get("layer_norm_epsilon", 1e-5)
    cfg = ModelConfig(
        vocab_size=c.get("vocab_size", 32768),
        d_model=hidden,
        layers=["mamba"] * c.get("num_hidden_layers", 64),
        mamba=MambaConfig(
            n_heads=heads, head_dim=head_dim, d_state=c.get("state_size", 128), n_groups=c.get("n_groups", 8),
            conv_kernel=c.get("conv_kernel", 4), conv_bias=c.get("use_conv_bias", True), proj_bias=c.get("use_bias", False),
            chunk_size=c.get("chunk_size", 256), dt_min=lo, dt_max=hi, norm_eps=eps,
        ),
        norm_eps=eps,
        tie_embeddings=c.get("tie_word_embeddings", False),
        **_special_ids(c, (0, 2, 1)),
    )

    def mapping(name):
        return name.removeprefix("backbone.")  # backbone.embeddings / layers.i.{norm,mixer} / norm_f

    return cfg, _prefix_renamer(mapping)


_NEMOTRON_KINDS = {
    "mamba": "mamba", "linear_attention": "mamba", "M": "mamba",
    "attention": "attention", "full_attention": "attention", "*": "attention",
    "mlp": "mlp", "-": "mlp",
}


def _config_nemotron_h(c: dict) -> tuple[ModelConfig, Renamer]:
    fmt = "NemotronH"
    blocks = c.get("layers_block_type") or c.get("layer_types")
    if blocks is None and c.get("hybrid_override_pattern") is not None:
        blocks = list(c["hybrid_override_pattern"])  # legacy string: M mamba, * attention, - mlp, E moe
    if not blocks:
        raise ModelLoadError(f"{fmt} config needs layers_block_type (or the legacy hybrid_override_pattern)")
    if any(b in ("moe", "E") for b in blocks):
        raise ModelLoadError(
            f"{fmt} config has mixture-of-experts layers (moe / E); ssmspec supports only mamba, attention "
            "and dense mlp layers, so use a dense Nemotron-H checkpoint"
        )
    unknown = sorted({b for b in blocks if b not in _NEMOTRON_KINDS})
    if unknown:
        raise ModelLoadError(f"{fmt} config has unknown layer types {unknown}")
    if c.get("num_nextn_predict_layers", 0):
        raise ModelLoadError(f"{fmt} config has multi-token-prediction layers; ssmspec does not load them")
    _require_silu(c, "mamba_hidden_act", fmt)
    eps = c.get("layer_norm_epsilon", 1e-5)
    # transformers renames the legacy mamba_* keys; accept both spellings.
    n_groups = c.get("n_groups", c.get("mamba_n_groups", 8))
    conv_kernel = c.get("conv_kernel", c.get("mamba_d_conv", 4))
    conv_bias = c.get("use_conv_bias", c.get("mamba_conv_bias", True))
    chunk = c.get("chunk_size", c.get("mamba_chunk_size", 128))
    dt_min = c.get("time_step_min", c.get("mamba_dt_min", 0.001))
    heads = c.get("num_attention_heads", 32)
    cfg = ModelConfig(
        vocab_size=c.get("vocab_size", 131072),
        d_model=c.get("hidden_size", 4096),
        layers=[_NEMOTRON_KINDS[b] for b in blocks],
        mamba=MambaConfig(
            n_heads=c.get("mamba_num_heads", 128), head_dim=c.get("mamba_head_dim", 64),
            d_state=c.get("ssm_state_size", 128), n_groups=n_groups, conv_kernel=conv_kernel, conv_bias=conv_bias,
            proj_bias=c.get("use_bias", False), chunk_size=chunk,
            # NemotronH's mixer clamps the time step to (time_step_min, inf), not time_step_limit.
            dt_min=float(dt_min), dt_max=math.inf, norm_eps=eps,
        ),
        # NemotronH attention is NoPE (no rotary) and its projections never have a bias.
        attention=AttentionConfig(
            n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c.get("attention_head_dim") or 128, rotary_dim=0,
        ),
        mlp=MLPConfig(
            d_intermediate=c.get("intermediate_size", 21504), gated=False,
            activation=c.get("mlp_hidden_act", "relu2"), bias=c.get("mlp_bias", False),
        ),
        norm_eps=eps,
        tie_embeddings=c.get("tie_word_embeddings", False),
        **_special_ids(c, (1, 2, 0)),
    )

    def mapping(name):
        for prefix in ("model.", "backbone."):  # remote-code checkpoints call the body "backbone"
            if name.startswith(prefix):
                return name[len(prefix):]
        return name

    return cfg, _prefix_renamer(mapping)


def _config_bamba(c: dict) -> tuple[ModelConfig, Renamer]:
    fmt = "Bamba"
    _require_silu(c, "hidden_act", fmt)
    hidden = c.get("hidden_size", 4096)
    n_layers = c.get("num_hidden_layers", 32)
    attn_idx = set(c.get("attn_layer_indices") or [])
    expand = c.get("mamba_expand", 2)
    m_heads = c.get("mamba_n_heads", 128)
    m_head_dim = c.get("mamba_d_head", "auto")
    if m_head_dim in (None, "auto"):
        m_head_dim = expand * hidden // m_heads
    if m_head_dim * m_heads != expand * hidden:
        raise ModelLoadError(f"{fmt} config: mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{fmt} config uses rope_type {rope['rope_type']!r}; only default RoPE is supported")
    theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
    heads = c.get("num_attention_heads", 32)
    head_dim = c.get("head_dim") or hidden // heads
    lo, hi = _dt_limit(c.get("time_step_limit"))
    eps = c.get("rms_norm_eps", 1e-5)
    layers = []
    for i in range(n_layers):
        layers += ["attention" if i in attn_idx else "mamba", "mlp"]
    cfg = ModelConfig(
        vocab_size=c.get("vocab_size", 128000),
        d_model=hidden,
        layers=layers,
        mamba=MambaConfig(
            n_heads=m_heads, head_dim=m_head_dim, d_state=c.get("mamba_d_state", 256),
            n_groups=c.get("mamba_n_groups", 1), conv_kernel=c.get("mamba_d_conv", 4),
            conv_bias=c.get("mamba_conv_bias", True), proj_bias=c.get("mamba_proj_bias", False),
            chunk_size=c.get("mamba_chunk_size", 256), dt_min=lo, dt_max=hi, norm_eps=eps,
        ),
        # Bamba hard-codes partial_rotary_factor = 0.5: RoPE on the first half of each head.
        attention=AttentionConfig(
            n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
            rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 0.5)), rope_theta=float(theta),
            qkv_bias=c.get("attention_bias", False), out_bias=c.get("attention_bias", False),
        ),
        mlp=MLPConfig(
            d_intermediate=c.get("intermediate_size", 14336), gated=True,
            activation=c.get("hidden_act", "silu"), bias=c.get("mlp_bias", False),
        ),
        norm_eps=eps,
        tie_embeddings=c.get("tie_word_embeddings", False),
        **_special_ids(c, (1, 2, 0)),
    )
    # Each Bamba decoder layer i is two of our sublayers: 2i (mamba or attention) and 2i+1 (MLP).
    parts = {
        "input_layernorm": (0, "norm"), "mamba": (0, "mixer"), "self_attn": (0, "mixer"),
        "pre_ff_layernorm": (1, "norm"), "feed_forward": (1, "mixer"),
    }

    def mapping(name):
        if name == "model.embed_tokens.weight":
            return "embeddings.weight"
        if name == "model.final_layernorm.weight":
            return "norm_f.weight"
        if name.startswith("model.layers."):
            _, _, idx, part, rest = name.split(".", 4)
            if part in parts:
                offset, ours = parts[part]
                return f"layers.{2 * int(idx) + offset}.{ours}.{rest}"
        return name  # lm_head.weight, or an unexpected name that the strict check reports

    return cfg, _prefix_renamer(mapping)


def _config_mamba_ssm(c: dict) -> tuple[ModelConfig, Renamer]:
    fmt = "mamba_ssm"
    d_model, n_layer = c["d_model"], c["n_layer"]
    ssm = dict(c.get("ssm_cfg") or {})
    if ssm.get("layer", "Mamba1") != "Mamba2":
        raise ModelLoadError(
            f"{fmt} config has ssm_cfg.layer={ssm.get('layer', 'Mamba1')!r}; ssmspec supports Mamba-2 layers only"
        )
    if not c.get("rms_norm", True):
        raise ModelLoadError(f"{fmt} config uses LayerNorm (rms_norm false); ssmspec supports RMSNorm models only")
    for key, ok in (("D_has_hdim", False), ("rmsnorm", True), ("norm_before_gate", False)):
        if ssm.get(key, ok) != ok:
            raise ModelLoadError(f"{fmt} config has ssm_cfg.{key}={ssm[key]!r}; ssmspec supports only {key}={ok}")
    d_inner = ssm.get("expand", 2) * d_model
    if ssm.get("d_ssm") not in (None, d_inner):
        raise ModelLoadError(f"{fmt} config has ssm_cfg.d_ssm != expand * d_model (a partial SSM); not supported")
    head_dim = ssm.get("headdim", 64)
    if d_inner % head_dim:
        raise ModelLoadError(f"{fmt} config: expand * d_model = {d_inner} is not a multiple of headdim {head_dim}")
    lo, hi = _dt_limit(ssm.get("dt_limit"))
    attn_idx = set(c.get("attn_layer_idx") or [])
    attn = dict(c.get("attn_cfg") or {})
    if attn_idx:
        if "num_heads" not in attn:
            raise ModelLoadError(f"{fmt} config has attn_layer_idx but attn_cfg lacks num_heads")
        for key, ok in (("mlp_dim", 0), ("d_conv", 0), ("rotary_emb_interleaved", False), ("causal", True)):
            default = False if key == "causal" else ok  # MHA's own default is causal=False
            if attn.get(key, default) != ok:
                raise ModelLoadError(f"{fmt} attn_cfg.{key}={attn.get(key, default)!r} is not supported (need {ok})")
    heads = attn.get("num_heads", 1)
    a_head_dim = attn.get("head_dim") or d_model // heads
    if attn.get("softmax_scale") not in (None, a_head_dim ** -0.5):
        raise ModelLoadError(f"{fmt} attn_cfg.softmax_scale other than 1/sqrt(head_dim) is not supported")
    d_inter = c.get("d_intermediate", 0)
    # GatedMLP rounds its hidden size up to a multiple of 128.
    mlp_hidden = (d_inter + 127) // 128 * 128 if d_inter else 0
    vocab = c.get("vocab_size", 50277)
    pad = c.get("pad_vocab_size_multiple", 8) or 1
    if vocab % pad:
        vocab += pad - vocab % pad
    layers, block_of = [], []  # block_of[j] = (mamba_ssm block i, 0 mixer / 1 mlp)
    for i in range(n_layer):
        layers.append("attention" if i in attn_idx else "mamba")
        block_of.append((i, 0))
        if mlp_hidden:
            layers.append("mlp")
            block_of.append((i, 1))
    eps = c.get("norm_epsilon", 1e-5)
    cfg = ModelConfig(
        vocab_size=vocab,
        d_model=d_model,
        layers=layers,
        mamba=MambaConfig(
            n_heads=d_inner // head_dim, head_dim=head_dim, d_state=ssm.get("d_state", 128),
            n_groups=ssm.get("ngroups", 1), conv_kernel=ssm.get("d_conv", 4), conv_bias=ssm.get("conv_bias", True),
            proj_bias=ssm.get("bias", False), chunk_size=ssm.get("chunk_size", 256), dt_min=lo, dt_max=hi,
            norm_eps=1e-5,  # mamba_ssm's Mamba2 hard-codes the gated norm's eps
        ),
        attention=AttentionConfig(
            n_heads=heads, n_kv_heads=attn.get("num_heads_kv") or heads, head_dim=a_head_dim,
            rotary_dim=attn.get("rotary_emb_dim", 0), rope_theta=float(attn.get("rotary_emb_base", 10000.0)),
            qkv_bias=attn.get("qkv_proj_bias", True), out_bias=attn.get("out_proj_bias", True),
        ),
        mlp=MLPConfig(d_intermediate=mlp_hidden or 64, gated=True, activation="silu", bias=False),
        norm_eps=eps,
        tie_embeddings=c.get("tie_embeddings", True),
    )
    ours = {}  # (block, part) -> our sublayer index
    for j, key in enumerate(block_of):
        ours[key] = j
    q_dim = heads * a_head_dim
    kv_dim = cfg.attention.n_kv_heads * a_head_dim

    def rename(name, t):
        if name == "backbone.embedding.weight":
            return [("embeddings.weight", t)]
        if name == "backbone.norm_f.weight":
            return [("norm_f.weight", t)]
        if not name.startswith("backbone.layers."):
            return [(name, t)]
        _, _, idx, part, rest = name.split(".", 4)
        i = int(idx)
        if part in ("norm", "mixer"):
            j = ours.get((i, 0))
            if j is None:
                return [(name, t)]
            if part == "mixer" and i in attn_idx:
                # Fused MHA projection: in_proj = [q | k | v] rows, out_proj -> o_proj.
                if rest.startswith("in_proj."):
                    leaf = rest.removeprefix("in_proj.")
                    if t.shape[0] != q_dim + 2 * kv_dim:
                        raise ModelLoadError(
                            f"{name} has {t.shape[0]} rows; attn_cfg implies q+k+v = {q_dim + 2 * kv_dim}"
                        )
                    q, k, v = t.split([q_dim, kv_dim, kv_dim], dim=0)
                    return [(f"layers.{j}.mixer.{p}_proj.{leaf}", x) for p, x in (("q", q), ("k", k), ("v", v))]
                if rest.startswith("out_proj."):
                    return [(f"layers.{j}.mixer.o_proj.{rest.removeprefix('out_proj.')}", t)]
            return [(f"layers.{j}.{part}.{rest}", t)]
        if part in ("norm2", "mlp"):
            j = ours.get((i, 1))
            if j is None:
                return [(name, t)]
            if part == "norm2":
                return [(f"layers.{j}.norm.{rest}", t)]
            if rest.startswith("fc1."):
                # GatedMLP: fc1 = [y | gate], out = fc2(y * silu(gate)): y is our up_proj.
                leaf = rest.removeprefix("fc1.")
                up, gate = t.chunk(2, dim=0)
                return [(f"layers.{j}.mixer.up_proj.{leaf}", up), (f"layers.{j}.mixer.gate_proj.{leaf}", gate)]
            if rest.startswith("fc2."):
                return [(f"layers.{j}.mixer.down_proj.{rest.removeprefix('fc2.')}", t)]
        return [(name, t)]

    return cfg, rename


def _config_native(c: dict) -> tuple[ModelConfig, Renamer]:
    body = c.get(NATIVE_MODEL_TYPE)
    if not isinstance(body, dict):
        raise ModelLoadError(f"ssmspec config.json lacks its {NATIVE_MODEL_TYPE!r} section; regenerate it with save_model")
    try:
        cfg = ModelConfig.from_dict(body)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"ssmspec config.json section is invalid: {e}") from e
    return cfg, _prefix_renamer(lambda n: n)


_FORMATS = {
    "mamba2": _config_mamba2,
    "nemotron_h": _config_nemotron_h,
    "bamba": _config_bamba,
    "mamba_ssm": _config_mamba_ssm,
    NATIVE_MODEL_TYPE: _config_native,
}


def _parse_config(cfg: dict) -> tuple[ModelConfig, str, Renamer]:
    fmt = detect_format(cfg)
    try:
        model_cfg, rename = _FORMATS[fmt](cfg)
    except ModelLoadError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{fmt} config.json cannot be mapped onto an ssmspec model: {e!r}") from e
    from .mlp import ACTIVATIONS

    if "mlp" in model_cfg.layers and model_cfg.mlp.activation not in ACTIVATIONS:
        raise ModelLoadError(
            f"{fmt} config uses MLP activation {model_cfg.mlp.activation!r}; ssmspec implements {', '.join(sorted(ACTIVATIONS))}"
        )
    return model_cfg, fmt, rename


def config_from_dict(cfg: dict) -> tuple[ModelConfig, str]:
    """Our ModelConfig and the format name for a parsed config.json of any supported format."""
    model_cfg, fmt, _ = _parse_config(cfg)
    return model_cfg, fmt


# -----------------------------------------------------------------------------------------------
# load
# -----------------------------------------------------------------------------------------------
def _map_state(source: dict[str, torch.Tensor], rename: Renamer) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in source.items():
        for new, t in rename(name, tensor):
            if new in out:
                raise ModelLoadError(f"two checkpoint tensors map onto {new}; the checkpoint is not a valid model")
            out[new] = t
    return out


def _check_and_fill(state: dict[str, torch.Tensor], model: LanguageModel, where: Path) -> dict[str, torch.Tensor]:
    expected = model.state_dict()
    if model.config.tie_embeddings:
        # Tied checkpoints may or may not store the head; when stored it must be the embedding.
        if "lm_head.weight" not in state and "embeddings.weight" in state:
            state["lm_head.weight"] = state["embeddings.weight"]
    missing = sorted(k for k in expected if k not in state)
    unexpected = sorted(k for k in state if k not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {_names(unexpected)}")
        raise ModelLoadError(
            f"weights in {where} do not match config.json: {'; '.join(parts)}. "
            "The config and weights must come from the same model"
        )
    for k, t in state.items():
        if tuple(t.shape) != tuple(expected[k].shape):
            raise ModelLoadError(
                f"weights in {where}: tensor {k} has shape {tuple(t.shape)} but config.json implies "
                f"{tuple(expected[k].shape)}; the config and weights must come from the same model"
            )
    return state


def _names(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def load_model(path, *, dtype=None, device="cpu") -> LoadedModel:
    """Load a model directory of any supported format into a LanguageModel.

    Args:
        path: directory with config.json and weights (safetensors, sharded safetensors, or .bin).
        dtype: parameter dtype ("fp32", "bf16", a torch dtype); None keeps the checkpoint's.
        device: where the parameters go.
    Returns:
        LoadedModel(model in eval mode, tokenizer or None, source_format, path).
    Raises:
        ModelLoadError with a sentence saying what to fix.
    """
    path = Path(path)
    cfg, fmt, rename = _parse_config(_read_config(path))
    source, _ = _read_weights(path)
    state = _map_state(source, rename)
    dtype = resolve_dtype(dtype)
    if dtype is None:
        floats = [t.dtype for t in state.values() if t.is_floating_point()]
        dtype = floats[0] if floats else torch.float32
    check_fits(cfg, device, dtype)
    model = empty_model(cfg, device=device, dtype=dtype)
    state = _check_and_fill(state, model, path)
    model.load_state_dict(state, strict=True)
    model.eval()
    return LoadedModel(model=model, tokenizer=_load_tokenizer(path), source_format=fmt, path=path)


# -----------------------------------------------------------------------------------------------
# save
# -----------------------------------------------------------------------------------------------
def mamba2_compatible(cfg: ModelConfig) -> bool:
    """Whether transformers' Mamba2ForCausalLM can represent this config exactly."""
    m = cfg.mamba
    return (
        cfg.is_pure_mamba
        and m.d_inner % cfg.d_model == 0
        and m.norm_eps == cfg.norm_eps  # transformers uses one layer_norm_epsilon for both norms
    )


def _mamba2_hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    from transformers import Mamba2Config

    m = cfg.mamba
    hf = Mamba2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=len(cfg.layers),
        num_heads=m.n_heads, head_dim=m.head_dim, state_size=m.d_state, n_groups=m.n_groups,
        expand=m.d_inner // cfg.d_model, conv_kernel=m.conv_kernel, use_conv_bias=m.conv_bias, use_bias=m.proj_bias,
        chunk_size=m.chunk_size, time_step_limit=(m.dt_min, m.dt_max), layer_norm_epsilon=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )
    hf.architectures = ["Mamba2ForCausalLM"]
    d = hf.to_dict()
    d["dtype"] = str(dtype).removeprefix("torch.")
    return d


def _write_safetensors(state: dict[str, torch.Tensor], file: Path) -> None:
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
    cfg: ModelConfig = model.config
    state = {k: v for k, v in model.state_dict().items()}
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; loaders re-tie
    if mamba2_compatible(cfg):
        fmt = "mamba2"
        config = _mamba2_hf_config(cfg, model.dtype)
        state = {("lm_head.weight" if k == "lm_head.weight" else f"backbone.{k}"): v for k, v in state.items()}
    else:
        fmt = NATIVE_MODEL_TYPE
        config = {
            "model_type": NATIVE_MODEL_TYPE, "format_version": NATIVE_FORMAT_VERSION,
            "dtype": str(model.dtype).removeprefix("torch."), NATIVE_MODEL_TYPE: cfg.to_dict(),
        }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _write_safetensors(state, tmp / "model.safetensors")
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        _default_permissions(tmp)
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
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return fmt


def _default_permissions(directory: Path) -> None:
    # mkdtemp makes a 0700 directory; give the result the modes a plain mkdir / open would.
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for f in directory.rglob("*"):
        f.chmod((0o777 if f.is_dir() else 0o666) & ~umask)


# -----------------------------------------------------------------------------------------------
# vocabulary checks and fingerprints
# -----------------------------------------------------------------------------------------------
def _unpack(x):
    if isinstance(x, LoadedModel):
        return x.model, x.tokenizer
    return x, getattr(x, "tokenizer", None)


def vocab_fingerprint(tokenizer) -> str:
    """Short sha256 of a tokenizer's (token, id) pairs."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()[:16]


def check_same_vocab(a, b, what_a: str = "target", what_b: str = "drafter") -> None:
    """Raise TokenizerMismatchError unless a and b (LoadedModel or LanguageModel) share a vocabulary."""
    model_a, tok_a = _unpack(a)
    model_b, tok_b = _unpack(b)
    va, vb = model_a.config.vocab_size, model_b.config.vocab_size
    if va != vb:
        raise TokenizerMismatchError(
            f"the {what_a} has vocab_size {va} but the {what_b} has {vb}; both must use the same tokenizer "
            f"(build the {what_b} with --vocab-from the {what_a}'s directory)"
        )
    if tok_a is not None and tok_b is not None:
        la, lb = len(tok_a), len(tok_b)
        if la != lb:
            raise TokenizerMismatchError(
                f"the {what_a}'s tokenizer has {la} tokens but the {what_b}'s has {lb} (model vocab_size {va}); "
                "both must use the same tokenizer"
            )
        fa, fb = vocab_fingerprint(tok_a), vocab_fingerprint(tok_b)
        if fa != fb:
            raise TokenizerMismatchError(
                f"the {what_a} and {what_b} tokenizers both have {la} tokens but different vocabularies "
                f"(fingerprints {fa} vs {fb}); both must use the same tokenizer"
            )


def effective_config_dict(cfg: ModelConfig) -> dict:
    """cfg.to_dict() without the sub-configs of layer kinds the model does not use."""
    d = cfg.to_dict()
    for kind in ("mamba", "attention", "mlp"):
        if kind not in cfg.layers:
            d.pop(kind)
    return d


def model_fingerprint(model) -> str:
    """Short sha256 of the config and every parameter's name, shape and dtype (not the values)."""
    model, _ = _unpack(model)
    h = hashlib.sha256(json.dumps(effective_config_dict(model.config), sort_keys=True).encode())
    for name, t in model.state_dict().items():
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
    return h.hexdigest()[:16]
