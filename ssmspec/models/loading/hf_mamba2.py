"""transformers' Mamba2ForCausalLM format: its config.json onto ours, and ours back for saving."""
from __future__ import annotations

import torch

from ...errors import ModelLoadError
from ..config import MambaConfig, ModelConfig
from .common import Renamer, dt_limit, prefix_renamer, require_silu, special_ids


def config_mamba2(c: dict) -> tuple[ModelConfig, Renamer]:
    """Mamba2Config fields (its defaults for missing ones) onto ours; tensors lose their "backbone." prefix."""
    fmt = "Mamba2"
    require_silu(c, "hidden_act", fmt)
    hidden = c.get("hidden_size", 4096)
    heads, head_dim = c.get("num_heads", 128), c.get("head_dim", 64)
    expand = c.get("expand", 2)
    if int(expand * hidden) != heads * head_dim:
        raise ModelLoadError(
            f"{fmt} config is inconsistent: expand * hidden_size = {int(expand * hidden)} but "
            f"num_heads * head_dim = {heads * head_dim}"
        )
    lo, hi = dt_limit(c.get("time_step_limit"))
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
        **special_ids(c, (0, 2, 1)),
    )

    def mapping(name):
        return name.removeprefix("backbone.")  # backbone.embeddings / layers.i.{norm,mixer} / norm_f

    return cfg, prefix_renamer(mapping)


def mamba2_compatible(cfg: ModelConfig) -> bool:
    """Whether transformers' Mamba2ForCausalLM can represent this config exactly."""
    m = cfg.mamba
    return (
        cfg.is_pure_mamba
        and m.d_inner % cfg.d_model == 0
        and m.norm_eps == cfg.norm_eps  # transformers uses one layer_norm_epsilon for both norms
    )


def mamba2_hf_config(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """config.json of Mamba2ForCausalLM for a config that `mamba2_compatible` accepts."""
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


def mamba2_tensor_name(name: str) -> str:
    """Our state_dict name -> Mamba2ForCausalLM's (the body lives under "backbone.")."""
    return name if name == "lm_head.weight" else f"backbone.{name}"
