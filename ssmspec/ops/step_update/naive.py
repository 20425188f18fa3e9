"""Plain-torch reference of the fused single-token Mamba-2 step (the same math as `Mamba2Mixer.step`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_mamba_step(
    xBC: torch.Tensor,
    dt_raw: torch.Tensor,
    z: torch.Tensor,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    dt_bias: torch.Tensor,
    A_log: torch.Tensor,
    D: torch.Tensor,
    norm_weight: torch.Tensor | None,
    n_groups: int,
    norm_groups: int,
    dt_min: float,
    dt_max: float,
    eps: float,
) -> torch.Tensor:
    """One token through conv update, SSM state update, D skip and gated RMSNorm.

    Updates conv_state and ssm_state in place. Rounding follows `Mamba2Mixer.step`: the conv
    output is rounded to xBC's dtype, y to z's dtype before the gate, the normalised value to
    z's dtype before the norm weight.

    Args:
        xBC: (B, C) pre-conv inputs, C = H*P + 2*G*S.
        dt_raw: (B, H) time steps before dt_bias and softplus.
        z: (B, H*P) gate.
        conv_state: (B, C, K-1) oldest first.
        ssm_state: (B, H, P, S) fp32.
        conv_weight: (C, K); conv_bias: (C,) or None.
        dt_bias, A_log, D: (H,); the decay rate is A = -exp(A_log), computed here so that a
            decode step spends no launches on it.
        norm_weight: (H*P,) weight of the gated RMSNorm, normalised over norm_groups groups; None
            when it has been folded into out_proj (ssmspec.models.fold).
        n_groups: G, groups of B and C.
    Returns:
        (B, H*P) in z's dtype, the input of out_proj.
    """
    batch, heads, head_dim, d_state = ssm_state.shape
    window = torch.cat([conv_state.to(xBC.dtype), xBC[:, :, None]], dim=-1)  # (B, C, K)
    conv_state.copy_(window[:, :, 1:])
    conv = (window.float() * conv_weight.float()).sum(-1)
    if conv_bias is not None:
        conv = conv + conv_bias.float()
    conv = F.silu(conv).to(xBC.dtype)
    d_inner = heads * head_dim
    x, B, C = conv.split([d_inner, n_groups * d_state, n_groups * d_state], dim=-1)
    x = x.unflatten(-1, (heads, head_dim))  # (B, H, P)
    Bh = B.unflatten(-1, (n_groups, d_state)).float().repeat_interleave(heads // n_groups, dim=1)  # (B, H, S)
    Ch = C.unflatten(-1, (n_groups, d_state)).float().repeat_interleave(heads // n_groups, dim=1)
    dt = F.softplus(dt_raw.float() + dt_bias.float()).clamp(dt_min, dt_max)  # (B, H)
    A = -torch.exp(A_log.float())
    state = ssm_state * torch.exp(dt * A)[..., None, None]
    state = state + torch.einsum("bh,bhp,bhs->bhps", dt, x.float(), Bh)
    ssm_state.copy_(state)
    y = torch.einsum("bhps,bhs->bhp", state, Ch) + x.float() * D.float()[:, None]
    y = y.flatten(-2).to(z.dtype)  # (B, H*P)
    g = y.float() * F.silu(z.float())
    g = g.unflatten(-1, (norm_groups, -1))
    g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    g = g.flatten(-2).to(z.dtype)
    return g if norm_weight is None else norm_weight * g


def naive_rms_norm(h: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in fp32, as `ssmspec.models.lm.RMSNorm`. h (..., D) -> (..., D) in h's dtype.
    weight None: no weight (folded into the next projection)."""
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (hf if weight is None else weight.float() * hf).to(h.dtype)


def naive_add_rms_norm(delta: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float):
    """The residual add of one sublayer and the next sublayer's RMSNorm, as `LanguageModel.step`
    does them: h + delta in h's dtype, then RMSNorm.

    Args:
        delta: (..., D) the sublayer output, or (SPLIT, ..., D) fp32 partial sums of it (a
            split-K projection); partials are summed and rounded to h's dtype first, as the
            projection's own output would be.
        h: (..., D) residual stream; weight: (D,).
    Returns:
        (h + delta, rms_norm(h + delta)), both (..., D) in h's dtype.
    """
    if delta.dim() == h.dim() + 1:
        delta = delta.sum(0).to(h.dtype)
    h = h + delta
    return h, naive_rms_norm(h, weight, eps)


def naive_gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """RMSNorm of y * silu(z) over groups of channels, as `ssmspec.models.mamba2.GatedRMSNorm`
    applied to y rounded to z's dtype (as `Mamba2Mixer._output` does before the norm).

    Args:
        y: (..., H*P) any float dtype (the scan's fp32 output); z: (..., H*P); weight: (H*P,).
    Returns:
        (..., H*P) in the dtype of weight * z.
    """
    y = y.to(z.dtype)
    dtype = y.dtype
    h = y.float() * F.silu(z.float())
    h = h.unflatten(-1, (-1, group_size))  # (..., groups, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.flatten(-2).to(dtype)


def naive_time_step(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    """softplus(dt_raw + dt_bias) clamped to [dt_min, dt_max] in fp32, as `Mamba2Mixer._time_step`.

    Args:
        dt_raw: (..., H); dt_bias: (H,). Returns (..., H) fp32.
    """
    return F.softplus(dt_raw.float() + dt_bias.float()).clamp(dt_min, dt_max)


def naive_mamba_step_out(xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                         norm_weight, n_groups, norm_groups, dt_min, dt_max, eps, out_weight, out_bias, residual=None):
    """`naive_mamba_step` followed by the mixer's out_proj (out_weight (d_model, H*P), out_bias
    (d_model,) or None) and, when residual (B, d_model) is given, the sublayer's residual add in
    residual's dtype. Returns (B, d_model); states updated in place."""
    out = F.linear(naive_mamba_step(xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                                    norm_weight, n_groups, norm_groups, dt_min, dt_max, eps), out_weight, out_bias)
    return out if residual is None else residual + out.to(residual.dtype)

