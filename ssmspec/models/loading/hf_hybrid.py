"""transformers' hybrid formats (NemotronH, Bamba, GraniteMoeHybrid, FalconH1, Zamba2): their config.json and tensor names onto ours."""
from __future__ import annotations

import math

import torch

from ...errors import ModelLoadError
from ..config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig, MoEConfig, SharedBlockConfig
from .common import Renamer, dt_limit, prefix_renamer, require_silu, special_ids


# NemotronH's block names (current and legacy pattern letters) -> our layer kinds.
_NEMOTRON_KINDS = {
    "mamba": "mamba", "linear_attention": "mamba", "M": "mamba",
    "attention": "attention", "full_attention": "attention", "*": "attention",
    "mlp": "mlp", "-": "mlp",
    "moe": "moe", "E": "moe",
}



def _mamba_heads(c: dict, hidden: int, fmt: str) -> tuple[int, int]:
    """(heads, head dim) of a Bamba-style config's mixer: `mamba_d_head` "auto" is expand * hidden / heads."""
    expand = c.get("mamba_expand", 2)
    heads = c.get("mamba_n_heads", 128)
    head_dim = c.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        head_dim = expand * hidden // heads
    if head_dim * heads != expand * hidden:
        raise ModelLoadError(f"{fmt} config: mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
    return heads, head_dim


def _mamba_config(c: dict, heads: int, head_dim: int, dt_min: float, dt_max: float, eps: float,
                  **overrides) -> MambaConfig:
    """The Mamba-2 mixer of a Bamba-style config (`mamba_*` keys: Bamba, GraniteMoeHybrid,
    FalconH1), with `overrides` for what a family spells differently."""
    fields = dict(
        n_heads=heads, head_dim=head_dim, d_state=c.get("mamba_d_state", 256), n_groups=c.get("mamba_n_groups", 1),
        conv_kernel=c.get("mamba_d_conv", 4), conv_bias=c.get("mamba_conv_bias", True),
        proj_bias=c.get("mamba_proj_bias", False), chunk_size=c.get("mamba_chunk_size", 256),
        dt_min=dt_min, dt_max=dt_max, norm_eps=eps,
    )
    return MambaConfig(**{**fields, **overrides})

def config_nemotron_h(c: dict) -> tuple[ModelConfig, Renamer]:
    """NemotronHConfig onto ours, one sublayer per block: mamba, attention, mlp, or moe (Nemotron 3:
    DeepSeek-V3 routing over plain experts, models/moe.py; the hub's per-expert tensors are
    stacked on load)."""
    fmt = "NemotronH"
    blocks = c.get("layers_block_type") or c.get("layer_types")
    if blocks is None and c.get("hybrid_override_pattern") is not None:
        blocks = list(c["hybrid_override_pattern"])  # legacy string: M mamba, * attention, - mlp, E moe
    if not blocks:
        raise ModelLoadError(f"{fmt} config needs layers_block_type (or the legacy hybrid_override_pattern)")
    if c.get("mlp_bias", False) and any(b in ("moe", "E") for b in blocks):
        raise ModelLoadError(f"{fmt} config has mlp_bias with mixture-of-experts layers; ssmspec reads them without")
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
        # MoE blocks (Nemotron 3): DeepSeek-V3 routing over plain (non-gated) experts.
        moe=MoEConfig(
            n_experts=c.get("n_routed_experts", c.get("num_local_experts", 128)), top_k=c.get("num_experts_per_tok", 2),
            d_intermediate=c.get("moe_intermediate_size", 7688),
            shared_intermediate=c.get("moe_shared_expert_intermediate_size", 7688),
            activation=c.get("mlp_hidden_act", "relu2"), gated=False, router="sigmoid",
            n_group=c.get("n_group", 1), topk_group=c.get("topk_group", 1),
            norm_topk_prob=c.get("norm_topk_prob", True), routed_scaling=float(c.get("routed_scaling_factor", 1.0)),
            latent_size=c.get("moe_latent_size") or 0,
        ),
        norm_eps=eps,
        tie_embeddings=c.get("tie_word_embeddings", False),
        **special_ids(c, (1, 2, 0)),
    )
    moe_parts = {"gate.weight": "router.weight", "gate.e_score_correction_bias": "score_bias",
                 "shared_experts.up_proj.weight": "shared.up_proj.weight",
                 "shared_experts.down_proj.weight": "shared.down_proj.weight"}
    n_experts = cfg.moe.n_experts
    per_expert: dict[str, dict[int, torch.Tensor]] = {}

    def rename(name, tensor):
        for prefix in ("model.", "backbone."):  # remote-code checkpoints call the body "backbone"
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        if not name.startswith("layers.") or ".mixer." not in name:
            return [(name, tensor)]
        layer, rest = name.split(".mixer.", 1)
        if rest in moe_parts:
            return [(f"{layer}.mixer.{moe_parts[rest]}", tensor)]
        if rest.startswith("experts.") and rest.count(".") == 3:
            # the hub's layout: one tensor per expert (experts.{j}.up_proj.weight), stacked here
            # once all of a layer's experts have come
            _, j, proj, _ = rest.split(".")
            key = f"{layer}.mixer.experts.{proj}"
            got = per_expert.setdefault(key, {})
            got[int(j)] = tensor
            if len(got) < n_experts:
                return []
            return [(key, torch.stack([got[e] for e in range(n_experts)]))]
        return [(name, tensor)]

    return cfg, rename


def config_bamba(c: dict) -> tuple[ModelConfig, Renamer]:
    """BambaConfig onto ours: each decoder layer becomes a mixer sublayer and an MLP sublayer."""
    fmt = "Bamba"
    require_silu(c, "hidden_act", fmt)
    hidden = c.get("hidden_size", 4096)
    n_layers = c.get("num_hidden_layers", 32)
    attn_idx = set(c.get("attn_layer_indices") or [])
    m_heads, m_head_dim = _mamba_heads(c, hidden, fmt)
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
        mamba=_mamba_config(c, m_heads, m_head_dim, lo, hi, eps),
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


# GraniteMoeHybrid's layer_types (and the older hub spellings) -> our mixer kinds.
_GRANITE_MIXERS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}


def config_granitemoehybrid(c: dict) -> tuple[ModelConfig, Renamer]:
    """GraniteMoeHybridConfig (Granite 4.0-H) onto ours: each decoder layer becomes a mixer
    sublayer (Mamba-2 or attention) and a feed-forward sublayer (MoE with its shared expert, or
    the shared expert alone as a gated MLP when num_local_experts is 0).

    Its multipliers: embedding_multiplier is kept (ModelConfig.embedding_multiplier);
    attention_multiplier is the softmax scale; residual_multiplier (each sublayer's output is
    scaled before the residual add) is folded into the last projection of every sublayer, and
    the 1 / logits_scaling of the logits into the final norm's weight, at load time: the same
    function up to rounding.
    """
    fmt = "GraniteMoeHybrid"
    require_silu(c, "hidden_act", fmt)
    hidden = c.get("hidden_size", 4096)
    n_layers = c.get("num_hidden_layers", 32)
    blocks = c.get("layer_types") or c.get("layers_block_type") or ["mamba"] * n_layers
    unknown = sorted({b for b in blocks if b not in _GRANITE_MIXERS})
    if unknown:
        raise ModelLoadError(f"{fmt} config has unknown layer types {unknown}")
    if len(blocks) != n_layers:
        raise ModelLoadError(f"{fmt} config lists {len(blocks)} layer types for {n_layers} layers")
    m_heads, m_head_dim = _mamba_heads(c, hidden, fmt)
    position = c.get("position_embedding_type")
    if position not in (None, "nope", "rope"):
        raise ModelLoadError(f"{fmt} config has position_embedding_type {position!r}; ssmspec reads rope or none")
    rope = c.get("rope_parameters") or {}
    if position == "rope" and rope.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{fmt} config uses rope_type {rope['rope_type']!r}; only default RoPE is supported")
    heads = c.get("num_attention_heads", 32)
    head_dim = c.get("head_dim") or hidden // heads
    experts = c.get("num_local_experts", 8) or 0
    lo, hi = dt_limit(c.get("time_step_limit"))
    eps = c.get("rms_norm_eps", 1e-6)
    ffn = "moe" if experts else "mlp"
    layers = []
    for b in blocks:
        layers += [_GRANITE_MIXERS[b], ffn]
    shared = c.get("shared_intermediate_size", 1024)
    cfg = ModelConfig(
        vocab_size=c.get("vocab_size", 32000),
        d_model=hidden,
        layers=layers,
        mamba=_mamba_config(c, m_heads, m_head_dim, lo, hi, eps),
        attention=AttentionConfig(
            n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
            rotary_dim=head_dim if position == "rope" else 0,
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            qkv_bias=c.get("attention_bias", False), out_bias=c.get("attention_bias", False),
            scale=float(c.get("attention_multiplier", 1.0)),
        ),
        mlp=MLPConfig(d_intermediate=shared, gated=True, activation=c.get("hidden_act", "silu")),
        moe=MoEConfig(
            n_experts=max(experts, 1), top_k=c.get("num_experts_per_tok", 2) if experts else 1,
            d_intermediate=c.get("intermediate_size", 11008), shared_intermediate=shared,
            activation=c.get("hidden_act", "silu"),
        ),
        norm_eps=eps,
        embedding_multiplier=float(c.get("embedding_multiplier", 1.0)),
        tie_embeddings=c.get("tie_word_embeddings", False),
        **special_ids(c, (1, 2, None)),
    )
    residual = float(c.get("residual_multiplier", 1.0))
    logits_scaling = float(c.get("logits_scaling", 1.0))
    mixer_parts = {"mamba": "mixer", "self_attn": "mixer"}
    # The last projection of each sublayer, whose output the residual multiplier scales.
    last = {"out_proj", "o_proj"}
    # Checkpoint names of the MoE (the hub's, which transformers writes back, and its in-memory ones).
    moe_names = {
        "block_sparse_moe.input_linear.weight": ("experts.gate_up_proj", 1.0),
        "block_sparse_moe.experts.gate_up_proj": ("experts.gate_up_proj", 1.0),
        "block_sparse_moe.output_linear.weight": ("experts.down_proj", residual),
        "block_sparse_moe.experts.down_proj": ("experts.down_proj", residual),
        "block_sparse_moe.router.layer.weight": ("router.weight", 1.0),
        "block_sparse_moe.router.weight": ("router.weight", 1.0),
    }
    shared_prefix = "shared." if experts else ""

    def rename(name, tensor):
        if name == "model.embed_tokens.weight":
            return [("embeddings.weight", tensor)]
        if name == "model.norm.weight":
            return [("norm_f.weight", tensor / logits_scaling)]
        if not name.startswith("model.layers."):
            return [(name, tensor)]  # lm_head.weight, or an unexpected name that the strict check reports
        _, _, idx, rest = name.split(".", 3)
        mixer, ffn = f"layers.{2 * int(idx)}", f"layers.{2 * int(idx) + 1}"
        part, _, tail = rest.partition(".")
        if part == "input_layernorm":
            return [(f"{mixer}.norm.{tail}", tensor)]
        if part == "post_attention_layernorm":
            return [(f"{ffn}.norm.{tail}", tensor)]
        if part in mixer_parts:
            scale = residual if tail.split(".")[0] in last else 1.0
            return [(f"{mixer}.mixer.{tail}", tensor * scale if scale != 1.0 else tensor)]
        if rest in moe_names:
            ours, scale = moe_names[rest]
            return [(f"{ffn}.mixer.{ours}", tensor * scale if scale != 1.0 else tensor)]
        if rest == "shared_mlp.input_linear.weight":  # [gate | up] rows, gate first
            gate, up = tensor.chunk(2, dim=0)
            return [(f"{ffn}.mixer.{shared_prefix}gate_proj.weight", gate),
                    (f"{ffn}.mixer.{shared_prefix}up_proj.weight", up)]
        if rest == "shared_mlp.output_linear.weight":
            return [(f"{ffn}.mixer.{shared_prefix}down_proj.weight", tensor * residual if residual != 1.0 else tensor)]
        return [(name, tensor)]

    return cfg, rename


def config_falcon_h1(c: dict) -> tuple[ModelConfig, Renamer]:
    """FalconH1Config onto ours: each decoder layer becomes three sublayers, a Mamba-2 mixer, an
    attention layer beside it (ModelConfig.parallel_layers: both read the same normed input and
    both outputs go to one residual add) and a gated MLP.

    Its multipliers are folded into the weights at load time (the same function up to rounding):
    ssm_in_multiplier and the per-segment ssm_multipliers (z, x, B, C, dt) into in_proj,
    ssm_out_multiplier into out_proj; attention_in_multiplier into q/k/v, key_multiplier into k,
    attention_out_multiplier into o_proj; mlp_multipliers into gate_proj and down_proj;
    lm_head_multiplier into the final norm's weight. embedding_multiplier is kept
    (ModelConfig.embedding_multiplier), as the LM head may be tied.
    """
    fmt = "FalconH1"
    require_silu(c, "hidden_act", fmt)
    gate_norm = bool(c.get("mamba_rms_norm", False))
    if gate_norm and c.get("mamba_norm_before_gate", True):
        raise ModelLoadError(
            f"{fmt} config has mamba_rms_norm and mamba_norm_before_gate both true; ssmspec implements the "
            "published Falcon-H1 mixers: no norm (mamba_rms_norm false) or the gated RMSNorm after the gate "
            "(mamba_norm_before_gate false)"
        )
    hidden = c.get("hidden_size", 4096)
    n_layers = c.get("num_hidden_layers", 32)
    d_ssm = c.get("mamba_d_ssm", 1024) or c.get("mamba_expand", 2) * hidden
    m_heads = c.get("mamba_n_heads", 128)
    m_head_dim = c.get("mamba_d_head", "auto")
    if m_head_dim in (None, "auto"):
        m_head_dim = d_ssm // m_heads
    if m_head_dim * m_heads != d_ssm:
        raise ModelLoadError(f"{fmt} config: mamba_n_heads * mamba_d_head must equal mamba_d_ssm")
    rope = c.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{fmt} config uses rope_type {rope['rope_type']!r}; only default RoPE is supported")
    heads = c.get("num_attention_heads", 32)
    head_dim = c.get("head_dim") or hidden // heads
    groups, d_state = c.get("mamba_n_groups", 1), c.get("mamba_d_state", 256)
    lo, hi = dt_limit(c.get("time_step_limit"))
    eps = c.get("rms_norm_eps", 1e-5)
    attention_bias = c.get("attention_bias", False)
    cfg = ModelConfig(
        vocab_size=c.get("vocab_size", 128000),
        d_model=hidden,
        layers=["mamba", "attention", "mlp"] * n_layers,
        parallel_layers=[3 * i + 1 for i in range(n_layers)],
        mamba=_mamba_config(c, m_heads, m_head_dim, lo, hi, eps, d_state=d_state, n_groups=groups,
                            gate_norm=gate_norm),
        attention=AttentionConfig(
            n_heads=heads, n_kv_heads=c.get("num_key_value_heads") or heads, head_dim=head_dim,
            rotary_dim=head_dim, rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            qkv_bias=attention_bias, out_bias=attention_bias,
        ),
        mlp=MLPConfig(d_intermediate=c.get("intermediate_size", 14336), gated=True,
                      activation=c.get("hidden_act", "silu"), bias=c.get("mlp_bias", False)),
        norm_eps=eps,
        embedding_multiplier=float(c.get("embedding_multiplier", 1.0)),
        tie_embeddings=c.get("tie_word_embeddings", False),
        **special_ids(c, (1, 2, 0)),
    )
    if c.get("projectors_bias", False) != cfg.mamba.proj_bias:
        raise ModelLoadError(f"{fmt} config: projectors_bias must equal mamba_proj_bias (one bias flag per mixer)")
    z, x, b, cc, dt = (float(v) for v in (c.get("ssm_multipliers") or [1.0] * 5))
    # in_proj's output channels [z | x B C | dt] scaled as transformers' mup_vector does
    mup = torch.cat([torch.full((d_ssm,), z), torch.full((d_ssm,), x), torch.full((groups * d_state,), b),
                     torch.full((groups * d_state,), cc), torch.full((m_heads,), dt)])
    ssm_in, ssm_out = float(c.get("ssm_in_multiplier", 1.0)), float(c.get("ssm_out_multiplier", 1.0))
    attn_in, key = float(c.get("attention_in_multiplier", 1.0)), float(c.get("key_multiplier", 1.0))
    attn_out = float(c.get("attention_out_multiplier", 1.0))
    gate_mult, down_mult = (float(v) for v in (c.get("mlp_multipliers") or [1.0, 1.0]))
    lm_head = float(c.get("lm_head_multiplier", 1.0))
    # (part, parameter) -> how the tensor is scaled: a factor, or mup for in_proj's rows.
    scales = {
        ("mamba", "in_proj.weight"): lambda t: t * (mup.to(t.dtype)[:, None] * ssm_in),
        ("mamba", "in_proj.bias"): lambda t: t * mup.to(t.dtype),
        ("mamba", "out_proj.weight"): lambda t: t * ssm_out,
        ("mamba", "out_proj.bias"): lambda t: t * ssm_out,
        ("self_attn", "q_proj.weight"): lambda t: t * attn_in,
        ("self_attn", "k_proj.weight"): lambda t: t * (attn_in * key),
        ("self_attn", "k_proj.bias"): lambda t: t * key,
        ("self_attn", "v_proj.weight"): lambda t: t * attn_in,
        ("self_attn", "o_proj.weight"): lambda t: t * attn_out,
        ("self_attn", "o_proj.bias"): lambda t: t * attn_out,
        ("feed_forward", "gate_proj.weight"): lambda t: t * gate_mult,
        ("feed_forward", "gate_proj.bias"): lambda t: t * gate_mult,
        ("feed_forward", "down_proj.weight"): lambda t: t * down_mult,
        ("feed_forward", "down_proj.bias"): lambda t: t * down_mult,
    }
    offsets = {"mamba": 0, "self_attn": 1, "feed_forward": 2}

    def rename(name, tensor):
        if name == "model.embed_tokens.weight":
            return [("embeddings.weight", tensor)]
        if name == "model.final_layernorm.weight":
            return [("norm_f.weight", tensor * lm_head)]
        if not name.startswith("model.layers."):
            return [(name, tensor)]  # lm_head.weight, or an unexpected name that the strict check reports
        _, _, idx, part, rest = name.split(".", 4)
        base = 3 * int(idx)
        if part == "input_layernorm":  # one norm feeds both mixers: each of our two sublayers gets it
            return [(f"layers.{base}.norm.{rest}", tensor), (f"layers.{base + 1}.norm.{rest}", tensor.clone())]
        if part == "pre_ff_layernorm":
            return [(f"layers.{base + 2}.norm.{rest}", tensor)]
        if part in offsets:
            scale = scales.get((part, rest))
            return [(f"layers.{base + offsets[part]}.mixer.{rest}", tensor if scale is None else scale(tensor))]
        return [(name, tensor)]

    return cfg, rename


_ZAMBA2_MAMBA = ("mamba", "linear_attention")


def config_zamba2(c: dict) -> tuple[ModelConfig, Renamer]:
    """Zamba2Config onto ours. A mamba layer is one Mamba-2 sublayer; a hybrid layer is a use of a
    shared transformer block (an attention sublayer, ModelConfig.shared_blocks) followed by its
    Mamba-2 sublayer, whose input gets the use's output added.

    Zamba2 ties each block's weights across its uses (num_mem_blocks blocks, used in turn), as
    transformers does when the checkpoint has tied embeddings; a checkpoint whose uses of one
    block hold different weights is refused.
    """
    fmt = "Zamba2"
    hidden = c.get("hidden_size", 2560)
    blocks = c.get("layers_block_type") or c.get("layer_types")
    if not blocks:
        raise ModelLoadError(f"{fmt} config needs layers_block_type")
    unknown = sorted({b for b in blocks if b not in _ZAMBA2_MAMBA + ("hybrid",)})
    if unknown:
        raise ModelLoadError(f"{fmt} config has unknown layer types {unknown}")
    if c.get("add_bias_linear", False):
        raise ModelLoadError(f"{fmt} config has add_bias_linear true; ssmspec reads Zamba2 without linear biases")
    if c.get("use_long_context", False):
        raise ModelLoadError(f"{fmt} config has use_long_context true (rescaled RoPE); ssmspec reads it off only")
    rope = c.get("rope_parameters") or {}
    if c.get("use_mem_rope", False) and rope.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{fmt} config uses rope_type {rope['rope_type']!r}; only default RoPE is supported")
    heads = c.get("num_attention_heads", 32)
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = 2 * hidden // heads
    attention_adapters = bool(c.get("use_shared_attention_adapter", False))
    if attention_adapters and kv_heads != heads:
        raise ModelLoadError(f"{fmt} config: attention adapters need num_key_value_heads equal to num_attention_heads")
    m_heads = c.get("n_mamba_heads", 8)
    expand = c.get("mamba_expand", 2)
    n_blocks = c.get("num_mem_blocks", 1)
    eps = c.get("rms_norm_eps", 1e-5)
    layers, sublayer_of = [], {}  # sublayer_of: decoder layer -> (its first sublayer, use index or None)
    uses = 0
    for i, b in enumerate(blocks):
        if b == "hybrid":
            sublayer_of[i] = (len(layers), uses)
            uses += 1
            layers += ["attention", "mamba"]
        else:
            sublayer_of[i] = (len(layers), None)
            layers.append("mamba")
    use_sublayer = {use: first for first, use in sublayer_of.values() if use is not None}
    cfg = ModelConfig(
        vocab_size=c.get("vocab_size", 32000),
        d_model=hidden,
        layers=layers,
        mamba=MambaConfig(
            n_heads=m_heads, head_dim=expand * hidden // m_heads, d_state=c.get("mamba_d_state", 64),
            n_groups=c.get("mamba_ngroups", 1), conv_kernel=c.get("mamba_d_conv", 4), conv_bias=True,
            proj_bias=False, chunk_size=c.get("chunk_size", 256),
            # Zamba2's mixer clamps the time step to (time_step_min, inf); its gated norm's eps is 1e-5.
            dt_min=float(c.get("time_step_min", 0.001)), dt_max=math.inf, norm_eps=1e-5,
        ),
        attention=AttentionConfig(
            n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim,
            rotary_dim=head_dim if c.get("use_mem_rope", False) else 0,
            rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
            scale=(head_dim / 2) ** -0.5,  # Zamba2 scales by sqrt(head_dim / 2)
        ),
        shared_blocks=SharedBlockConfig(
            n_blocks=n_blocks, d_intermediate=c.get("intermediate_size") or 4 * hidden,
            activation=c.get("hidden_act", "gelu"), adapter_rank=c.get("adapter_rank", 128),
            attention_adapters=attention_adapters,
        ),
        norm_eps=eps,
        tie_embeddings=c.get("tie_word_embeddings", True),
        **special_ids(c, (1, 2, 0)),
    )
    shared_parts = {
        "input_layernorm.weight": "input_norm.weight", "pre_ff_layernorm.weight": "ff_norm.weight",
        "feed_forward.gate_up_proj.weight": "gate_up_proj.weight", "feed_forward.down_proj.weight": "down_proj.weight",
        **{f"self_attn.{p}_proj.weight": f"attention.{p}_proj.weight" for p in "qkvo"},
    }
    adapter_lists = {
        "self_attn.linear_q_adapter_list": "q_adapter", "self_attn.linear_k_adapter_list": "k_adapter",
        "self_attn.linear_v_adapter_list": "v_adapter", "feed_forward.gate_up_proj_adapter_list": "gate_up_adapter",
    }
    seen: dict[str, torch.Tensor] = {}

    def once(ours: str, tensor: torch.Tensor):
        """A tied tensor stored under several uses: emitted once, after checking the copies agree."""
        if ours in seen:
            if not torch.equal(seen[ours], tensor):
                raise ModelLoadError(
                    f"{fmt} checkpoint holds different weights for {ours} in two uses of one shared block; "
                    "ssmspec reads Zamba2 with its shared blocks tied (as transformers ties them)")
            return []
        seen[ours] = tensor
        return [(ours, tensor)]

    def rename(name, tensor):
        if name == "model.embed_tokens.weight":
            return [("embeddings.weight", tensor)]
        if name == "model.final_layernorm.weight":
            return [("norm_f.weight", tensor)]
        if not name.startswith("model.layers."):
            return [(name, tensor)]  # lm_head.weight, or an unexpected name that the strict check reports
        _, _, idx, rest = name.split(".", 3)
        first, use = sublayer_of.get(int(idx), (None, None))
        if first is None:
            return [(name, tensor)]
        if use is None:  # a mamba layer
            if rest == "input_layernorm.weight":
                return [(f"layers.{first}.norm.weight", tensor)]
            if rest.startswith("mamba."):
                return [(f"layers.{first}.mixer.{rest.removeprefix('mamba.')}", tensor)]
            return [(name, tensor)]
        if rest == "linear.weight":
            return [(f"layers.{first}.mixer.out_proj.weight", tensor)]
        if rest == "mamba_decoder.input_layernorm.weight":
            return [(f"layers.{first + 1}.norm.weight", tensor)]
        if rest.startswith("mamba_decoder.mamba."):
            return [(f"layers.{first + 1}.mixer.{rest.removeprefix('mamba_decoder.mamba.')}", tensor)]
        part = rest.removeprefix("shared_transformer.")
        if part in shared_parts:
            return once(f"shared_blocks.{use % n_blocks}.{shared_parts[part]}", tensor)
        for prefix, ours in adapter_lists.items():
            if part.startswith(prefix + "."):
                k, tail = part[len(prefix) + 1:].split(".", 1)  # adapter of use k: "0.weight" / "1.weight"
                if int(k) not in use_sublayer:
                    return [(name, tensor)]
                return once(f"layers.{use_sublayer[int(k)]}.mixer.{ours}.{tail}", tensor)
        return [(name, tensor)]

    return cfg, rename
