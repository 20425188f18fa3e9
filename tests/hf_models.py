"""Tiny random transformers checkpoints (Mamba2, NemotronH, Bamba, GraniteMoeHybrid, FalconH1, Zamba2): the oracles of the equivalence tests.

`clamp=True` gives time-step limits that bind on a third of the heads, so the clamp is tested;
`clamp=False` gives none that bind, for comparisons with transformers' cached `generate`, whose
single-token path skips the clamp.
"""
from __future__ import annotations

import math

import torch
import transformers

VOCAB = 97


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int, std: float = 0.15, dt_floor: float | None = None) -> None:
    """Non-trivial weights: random projections, norms near 1, A in [1, 16], dt spread over decades.

    With dt_floor, a third of the heads get time steps below it, so the clamp matters.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("A_log"):
            p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=gen)))
        elif name.endswith("dt_bias"):
            dt = torch.exp(torch.rand(p.shape, generator=gen) * (math.log(0.3) - math.log(1e-3)) + math.log(1e-3))
            if dt_floor is not None:
                dt[::3] = dt_floor / 4
            p.copy_(dt + torch.log(-torch.expm1(-dt)))
        elif name.endswith(".D"):
            p.copy_(0.5 + torch.rand(p.shape, generator=gen))
        elif "norm" in name and name.endswith("weight"):
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
        elif "conv1d" in name:
            p.copy_(0.4 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(std * torch.randn(p.shape, generator=gen))
    model.eval()


def mamba2(clamp: bool = True, seed: int = 1):
    cfg = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_heads=8, head_dim=8, expand=2,
        state_size=8, n_groups=2, conv_kernel=4, chunk_size=8,
        time_step_limit=(0.002, 0.2) if clamp else (0.0, float("inf")),
        layer_norm_epsilon=1e-5, tie_word_embeddings=False,
    )
    model = transformers.Mamba2ForCausalLM(cfg)
    randomize(model, seed=seed)
    return model


def nemotron_h(clamp: bool = True, seed: int = 2):
    cfg = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32,
        layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention", "mlp", "full_attention"],
        mamba_num_heads=8, mamba_head_dim=6, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40,
        mlp_hidden_act="relu2", time_step_min=0.01 if clamp else 1e-6, layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
    )
    model = transformers.NemotronHForCausalLM(cfg)
    randomize(model, seed=seed, dt_floor=0.01 if clamp else None)
    return model


def nemotron_h_moe(clamp: bool = True, seed: int = 7, latent: int | None = 24):
    """NemotronH with MoE blocks (Nemotron 3): 8 plain squared-ReLU experts in 4 groups, top 3
    from the best 2 groups by sigmoid scores plus their correction bias, routed scaling, a
    shared expert and (latent) a down/up projection around the experts."""
    cfg = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32,
        layers_block_type=["linear_attention", "moe", "full_attention", "moe", "linear_attention", "mlp"],
        mamba_num_heads=8, mamba_head_dim=6, ssm_state_size=8, n_groups=2, conv_kernel=4, chunk_size=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40,
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=24, moe_latent_size=latent, routed_scaling_factor=1.7,
        norm_topk_prob=True, mlp_hidden_act="relu2", time_step_min=0.01 if clamp else 1e-6,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False, num_nextn_predict_layers=0,
    )
    model = transformers.NemotronHForCausalLM(cfg)
    randomize(model, seed=seed, dt_floor=0.01 if clamp else None)
    with torch.no_grad():  # the choice bias matters: spread it like the router's own scores
        gen = torch.Generator().manual_seed(seed)
        for layer in model.model.layers:
            if hasattr(layer.mixer, "gate"):
                layer.mixer.gate.e_score_correction_bias.copy_(0.3 * torch.randn(8, generator=gen))
    return model


def bamba(clamp: bool = True, seed: int = 3, intermediate_size: int = 40):
    cfg = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, attn_layer_indices=[1],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=intermediate_size,
        mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=8, time_step_limit=(0.0, 0.25) if clamp else (0.0, float("inf")), rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0}, tie_word_embeddings=False,
    )
    model = transformers.BambaForCausalLM(cfg)
    randomize(model, seed=seed)
    return model


def granitemoehybrid(clamp: bool = True, seed: int = 4, experts: int = 4, rope: bool = True):
    """Mamba-2 and attention mixers, each followed by 4 experts (top 2) and the shared expert,
    with every multiplier away from 1; experts=0 gives the dense variant (shared MLP only)."""
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "mamba"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=24, shared_intermediate_size=20,
        num_local_experts=experts, num_experts_per_tok=2,
        mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=8, time_step_limit=(0.0, 0.25) if clamp else (0.0, float("inf")), rms_norm_eps=1e-5,
        position_embedding_type="rope" if rope else None,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0},
        embedding_multiplier=2.0, residual_multiplier=0.6, logits_scaling=2.5, attention_multiplier=0.3,
        tie_word_embeddings=False,
    )
    model = transformers.GraniteMoeHybridForCausalLM(cfg)
    randomize(model, seed=seed)
    return model


def falcon_h1(clamp: bool = True, seed: int = 5, tied: bool = False, gate_norm: bool = True):
    """Attention beside Mamba-2 in every layer, with every multiplier (and each of the five
    ssm_multipliers segments) away from 1, a Mamba width (mamba_d_ssm) unrelated to hidden_size,
    and a head_dim other than hidden / heads. gate_norm=False: the mixer without its gated
    RMSNorm (mamba_rms_norm false, as Falcon-H1-0.5B ships)."""
    cfg = transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=12, intermediate_size=40, mamba_d_ssm=48, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=8,
        mamba_d_conv=4, mamba_chunk_size=8, mamba_rms_norm=gate_norm, mamba_norm_before_gate=False,
        time_step_limit=(0.0, 0.25) if clamp else (0.0, float("inf")), rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 300.0},
        embedding_multiplier=1.7, lm_head_multiplier=0.6, ssm_in_multiplier=0.8, ssm_out_multiplier=1.3,
        ssm_multipliers=[0.7, 1.2, 0.9, 1.4, 0.5], attention_in_multiplier=1.1, attention_out_multiplier=0.9,
        key_multiplier=0.6, mlp_multipliers=[1.3, 0.7], tie_word_embeddings=tied,
    )
    model = transformers.FalconH1ForCausalLM(cfg)
    randomize(model, seed=seed)
    return model


def zamba2(clamp: bool = True, seed: int = 6, blocks: int = 2, attention_adapters: bool = True, rope: bool = True):
    """Three uses of two shared blocks (uses 0 and 2 share block 0) between Mamba-2 layers, with
    per-use adapters, RoPE on the shared attention and tied embeddings (Zamba2's default, under
    which transformers ties each block's weights across its uses)."""
    cfg = transformers.Zamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"],
        num_mem_blocks=blocks, use_shared_attention_adapter=attention_adapters, adapter_rank=4,
        use_mem_rope=rope, rope_parameters={"rope_type": "default", "rope_theta": 300.0},
        num_attention_heads=4, n_mamba_heads=8, mamba_ngroups=2, mamba_d_state=8, mamba_d_conv=4,
        intermediate_size=48, chunk_size=8, time_step_min=0.01 if clamp else 1e-6, rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    model = transformers.Zamba2ForCausalLM(cfg)
    randomize(model, seed=seed, dt_floor=0.01 if clamp else None)
    return model


BUILDERS = {"mamba2": mamba2, "nemotron_h": nemotron_h, "bamba": bamba, "granitemoehybrid": granitemoehybrid,
            "falcon_h1": falcon_h1, "zamba2": zamba2}
