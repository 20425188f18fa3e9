"""The reference of a whole folded Mamba-2 sublayer for one token: the pre-norm (its weight
folded into in_proj), in_proj, the step (conv update, SSM state update, gated norm with its
weight folded into out_proj), out_proj and the residual add. It is the composition of the two
references the kernel path used before it was fused (ops/gemv, ops/step_update)."""
from __future__ import annotations

import torch

from ..gemv.naive import naive_norm_linear
from ..step_update.naive import naive_mamba_step_out


def naive_mamba_layer_step(h: torch.Tensor, in_weight: torch.Tensor, in_bias: torch.Tensor | None, pre_eps: float,
                           conv_state: torch.Tensor, ssm_state: torch.Tensor, conv_weight: torch.Tensor,
                           conv_bias: torch.Tensor | None, dt_bias: torch.Tensor, A_log: torch.Tensor,
                           D: torch.Tensor, n_groups: int, norm_groups: int, dt_min: float, dt_max: float,
                           eps: float, out_weight: torch.Tensor, out_bias: torch.Tensor | None) -> torch.Tensor:
    """h + mixer(RMSNorm(h)) for one token, both norms' weights folded into the projections.

    Args:
        h: (B, D) residual stream; in_weight: (2*H*P + 2*G*S + H, D); out_weight: (D, H*P).
        conv_state (B, C, K-1) and ssm_state (B, H, P, S) fp32 are updated in place.
    Returns:
        (B, D) in h's dtype.
    """
    heads, head_dim = ssm_state.shape[1:3]
    d_inner = heads * head_dim
    proj = naive_norm_linear(h, in_weight, in_bias, 1, pre_eps)
    z, xBC, dt_raw = proj.split([d_inner, conv_weight.shape[0], heads], dim=-1)
    return naive_mamba_step_out(xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                                None, n_groups, norm_groups, dt_min, dt_max, eps, out_weight, out_bias, residual=h)
