"""Tiny random transformers checkpoints (Mamba2, NemotronH, Bamba): the oracles of the equivalence tests.

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


BUILDERS = {"mamba2": mamba2, "nemotron_h": nemotron_h, "bamba": bamba}
