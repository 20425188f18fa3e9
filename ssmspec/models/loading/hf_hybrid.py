"""transformers' hybrid formats, NemotronH and Bamba: their config.json and tensor names onto ours."""
from __future__ import annotations

import math

from ...errors import ModelLoadError
from ..config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig
from .common import Renamer, dt_limit, prefix_renamer, require_silu, special_ids


# NemotronH's block names (current and legacy pattern letters) -> our layer kinds.
_NEMOTRON_KINDS = {
    "mamba": "mamba", "linear_attention": "mamba", "M": "mamba",
    "attention": "attention", "full_attention": "attention", "*": "attention",
    "mlp": "mlp", "-": "mlp",
}


def config_nemotron_h(c: dict) -> tuple[ModelConfig, Renamer]:
    """NemotronHConfig (dense: mamba, attention and mlp blocks) onto ours, one sublayer per block."""
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
    require_silu(c, "mamba_hidden_act", fmt)
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
        **special_ids(c, (1, 2, 0)),
    )

    def mapping(name):
        for prefix in ("model.", "backbone."):  # remote-code checkpoints call the body "backbone"
            if name.startswith(prefix):
                return name[len(prefix):]
        return name

    return cfg, prefix_renamer(mapping)


def config_bamba(c: dict) -> tuple[ModelConfig, Renamer]:
    """BambaConfig onto ours: each decoder layer becomes a mixer sublayer and an MLP sublayer."""
    fmt = "Bamba"
    require_silu(c, "hidden_act", fmt)
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
    lo, hi = dt_limit(c.get("time_step_limit"))
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
        **special_ids(c, (1, 2, 0)),
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

    return cfg, prefix_renamer(mapping)
