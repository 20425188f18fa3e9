"""state-spaces/mamba_ssm's MambaLMHeadModel format (Mamba-2 layers, optional MHA and GatedMLP) onto ours."""
from __future__ import annotations

from ...errors import ModelLoadError
from ..config import AttentionConfig, MambaConfig, MLPConfig, ModelConfig
from .common import Renamer, dt_limit


FMT = "mamba_ssm"


def config_mamba_ssm(c: dict) -> tuple[ModelConfig, Renamer]:
    """MambaLMHeadModel's config.json (d_model, n_layer, ssm_cfg, attn_cfg, ...) onto ours.

    Each mamba_ssm block i is one of our sublayers (mamba or attention), followed by an MLP
    sublayer when d_intermediate > 0; fused projections are split on the way in.
    """
    d_model, n_layer = c["d_model"], c["n_layer"]
    ssm = dict(c.get("ssm_cfg") or {})
    attn_idx = set(c.get("attn_layer_idx") or [])
    attn = dict(c.get("attn_cfg") or {})
    _check_supported(c, ssm, attn, attn_idx)
    d_inner = ssm.get("expand", 2) * d_model
    head_dim = ssm.get("headdim", 64)
    if d_inner % head_dim:
        raise ModelLoadError(f"{FMT} config: expand * d_model = {d_inner} is not a multiple of headdim {head_dim}")
    lo, hi = dt_limit(ssm.get("dt_limit"))
    heads = attn.get("num_heads", 1)
    a_head_dim = attn.get("head_dim") or d_model // heads
    if attn.get("softmax_scale") not in (None, a_head_dim ** -0.5):
        raise ModelLoadError(f"{FMT} attn_cfg.softmax_scale other than 1/sqrt(head_dim) is not supported")
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
    ours = {key: j for j, key in enumerate(block_of)}  # (block, part) -> our sublayer index
    return cfg, _renamer(ours, attn_idx, q_dim=heads * a_head_dim, kv_dim=cfg.attention.n_kv_heads * a_head_dim)


def _check_supported(c: dict, ssm: dict, attn: dict, attn_idx: set) -> None:
    """Refuse the mamba_ssm options our layers do not implement, naming the option."""
    if ssm.get("layer", "Mamba1") != "Mamba2":
        raise ModelLoadError(
            f"{FMT} config has ssm_cfg.layer={ssm.get('layer', 'Mamba1')!r}; ssmspec supports Mamba-2 layers only"
        )
    if not c.get("rms_norm", True):
        raise ModelLoadError(f"{FMT} config uses LayerNorm (rms_norm false); ssmspec supports RMSNorm models only")
    for key, ok in (("D_has_hdim", False), ("rmsnorm", True), ("norm_before_gate", False)):
        if ssm.get(key, ok) != ok:
            raise ModelLoadError(f"{FMT} config has ssm_cfg.{key}={ssm[key]!r}; ssmspec supports only {key}={ok}")
    d_inner = ssm.get("expand", 2) * c["d_model"]
    if ssm.get("d_ssm") not in (None, d_inner):
        raise ModelLoadError(f"{FMT} config has ssm_cfg.d_ssm != expand * d_model (a partial SSM); not supported")
    if attn_idx:
        if "num_heads" not in attn:
            raise ModelLoadError(f"{FMT} config has attn_layer_idx but attn_cfg lacks num_heads")
        for key, ok in (("mlp_dim", 0), ("d_conv", 0), ("rotary_emb_interleaved", False), ("causal", True)):
            default = False if key == "causal" else ok  # MHA's own default is causal=False
            if attn.get(key, default) != ok:
                raise ModelLoadError(f"{FMT} attn_cfg.{key}={attn.get(key, default)!r} is not supported (need {ok})")


def _renamer(ours: dict, attn_idx: set, q_dim: int, kv_dim: int) -> Renamer:
    """mamba_ssm tensor names onto ours; `ours` maps (block i, 0 mixer / 1 mlp) to our sublayer index."""

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

    return rename
