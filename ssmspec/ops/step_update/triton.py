"""Triton kernels of the fused single-token Mamba-2 step and of RMSNorm; `naive.py` is the spec.

The reference step runs ~40 tiny torch ops per layer; at batch 1 each is a few microseconds of
launch and tail, which across 64 layers costs more than reading the weights. Here the step is
two launches:

1. `_step_ssm_kernel`, one program per (batch row, head): the head's conv update (its P x
   channels, whose conv state it owns and shifts), the conv of its group's B and C channels
   (read-only: every head of the group reads them), dt, the (P, S) state update, y, the D skip
   and the gate y * silu(z), written as fp32 (B, H*P).
2. `_gated_norm_kernel`, one program per (batch row, norm group): the RMSNorm over the group and
   the norm weight; it also shifts the conv state of the B and C channels, which could not be
   done in (1) without racing with other heads still reading the old window.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    # torch's softplus with its default threshold 20 (linear above it).
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _step_ssm_kernel(
    xbc_ptr, dtr_ptr, z_ptr, cs_ptr, h_ptr, cw_ptr, cb_ptr, dtb_ptr, Alog_ptr, D_ptr, g_ptr,
    H, P, S, G, heads_per_group, dt_min, dt_max,
    sxb, sxc, sdb, sdh, szb, szc,
    scb, scc, sck,
    shb, shh, shp, shs,
    swc, swk,
    sgb,
    K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // heads_per_group
    offs_p = tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    mask_p = offs_p < P
    mask_s = offs_s < S
    d_inner = H * P
    cx = h * P + offs_p  # this head's x channels
    cB = d_inner + grp * S + offs_s
    cC = d_inner + G * S + grp * S + offs_s

    # Conv windows, oldest first; the current token multiplies weight[:, K-1].
    in_dtype = xbc_ptr.dtype.element_ty
    new_x = tl.load(xbc_ptr + b * sxb + cx * sxc, mask=mask_p, other=0.0)
    new_B = tl.load(xbc_ptr + b * sxb + cB * sxc, mask=mask_s, other=0.0)
    new_C = tl.load(xbc_ptr + b * sxb + cC * sxc, mask=mask_s, other=0.0)
    acc_x = new_x.to(tl.float32) * tl.load(cw_ptr + cx * swc + (K - 1) * swk, mask=mask_p, other=0.0).to(tl.float32)
    acc_B = new_B.to(tl.float32) * tl.load(cw_ptr + cB * swc + (K - 1) * swk, mask=mask_s, other=0.0).to(tl.float32)
    acc_C = new_C.to(tl.float32) * tl.load(cw_ptr + cC * swc + (K - 1) * swk, mask=mask_s, other=0.0).to(tl.float32)
    state_row = cs_ptr + b * scb
    for k in tl.static_range(K - 1):
        old_x = tl.load(state_row + cx * scc + k * sck, mask=mask_p, other=0.0)
        acc_x += old_x.to(in_dtype).to(tl.float32) * tl.load(cw_ptr + cx * swc + k * swk, mask=mask_p, other=0.0).to(tl.float32)
        # Shift this head's own x channels now: slot k-1 was read by the same thread one
        # iteration ago (same 1-D layout for loads and stores), so this cannot race.
        if k > 0:
            tl.store(state_row + cx * scc + (k - 1) * sck, old_x, mask=mask_p)
        old_B = tl.load(state_row + cB * scc + k * sck, mask=mask_s, other=0.0).to(in_dtype).to(tl.float32)
        acc_B += old_B * tl.load(cw_ptr + cB * swc + k * swk, mask=mask_s, other=0.0).to(tl.float32)
        old_C = tl.load(state_row + cC * scc + k * sck, mask=mask_s, other=0.0).to(in_dtype).to(tl.float32)
        acc_C += old_C * tl.load(cw_ptr + cC * swc + k * swk, mask=mask_s, other=0.0).to(tl.float32)
    tl.store(state_row + cx * scc + (K - 2) * sck, new_x.to(cs_ptr.dtype.element_ty), mask=mask_p)
    if HAS_BIAS:
        acc_x += tl.load(cb_ptr + cx, mask=mask_p, other=0.0).to(tl.float32)
        acc_B += tl.load(cb_ptr + cB, mask=mask_s, other=0.0).to(tl.float32)
        acc_C += tl.load(cb_ptr + cC, mask=mask_s, other=0.0).to(tl.float32)
    # silu, then round to the input dtype as the reference's conv output is.
    x = (acc_x * tl.sigmoid(acc_x)).to(in_dtype).to(tl.float32)
    Bv = (acc_B * tl.sigmoid(acc_B)).to(in_dtype).to(tl.float32)
    Cv = (acc_C * tl.sigmoid(acc_C)).to(in_dtype).to(tl.float32)

    dt = _softplus(tl.load(dtr_ptr + b * sdb + h * sdh).to(tl.float32) + tl.load(dtb_ptr + h).to(tl.float32))
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(-dt * tl.exp(tl.load(Alog_ptr + h).to(tl.float32)))  # A = -exp(A_log)
    h_ptrs = h_ptr + b * shb + h * shh + offs_p[:, None] * shp + offs_s[None, :] * shs
    mask_ps = mask_p[:, None] & mask_s[None, :]
    state = tl.load(h_ptrs, mask=mask_ps, other=0.0)
    state = state * decay + (dt * x)[:, None] * Bv[None, :]
    tl.store(h_ptrs, state, mask=mask_ps)
    y = tl.sum(state * Cv[None, :], axis=1) + x * tl.load(D_ptr + h).to(tl.float32)
    zv = tl.load(z_ptr + b * szb + cx * szc, mask=mask_p, other=0.0).to(tl.float32)
    out_dtype = z_ptr.dtype.element_ty
    gated = y.to(out_dtype).to(tl.float32) * (zv * tl.sigmoid(zv))
    tl.store(g_ptr + b * sgb + cx, gated, mask=mask_p)


@triton.jit
def _gated_norm_kernel(
    g_ptr, w_ptr, out_ptr, xbc_ptr, cs_ptr,
    group_size, d_inner, S, G, eps,
    sgb, sob, sxb, sxc, scb, scc, sck,
    K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    ng = tl.program_id(1)
    base = ng * group_size
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, group_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(g_ptr + b * sgb + base + offs, mask=offs < group_size, other=0.0)
        sq += v * v
    r = tl.rsqrt(tl.sum(sq, axis=0) / group_size + eps)
    out_dtype = out_ptr.dtype.element_ty
    for start in range(0, group_size, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < group_size
        v = tl.load(g_ptr + b * sgb + base + offs, mask=m, other=0.0)
        w = tl.load(w_ptr + base + offs, mask=m, other=0.0)
        out = (w.to(tl.float32) * (v * r).to(out_dtype).to(tl.float32)).to(out_dtype)
        tl.store(out_ptr + b * sob + base + offs, out, mask=m)

    # The deferred conv-state shift of the B and C channels (see the module docstring). Norm
    # group ng shifts B/C groups ng, ng + NG, ... so that every B/C group is shifted exactly once.
    NG = tl.num_programs(1)
    offs_s = tl.arange(0, BLOCK_S)
    for grp in range(ng, G, NG):
        for which in tl.static_range(2):
            ch = d_inner + which * G * S + grp * S + offs_s
            m = offs_s < S
            row = cs_ptr + b * scb + ch * scc
            for k in tl.static_range(1, K - 1):
                tl.store(row + (k - 1) * sck, tl.load(row + k * sck, mask=m, other=0.0), mask=m)
            new = tl.load(xbc_ptr + b * sxb + ch * sxc, mask=m, other=0.0)
            tl.store(row + (K - 2) * sck, new.to(cs_ptr.dtype.element_ty), mask=m)


def mamba_step(
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
    norm_weight: torch.Tensor,
    n_groups: int,
    norm_groups: int,
    dt_min: float,
    dt_max: float,
    eps: float,
) -> torch.Tensor:
    """One token through conv update, SSM state update, D skip and gated RMSNorm (two launches).

    Same contract as `naive_mamba_step`; conv_state and ssm_state are updated in place.

    Args:
        xBC: (B, C); dt_raw: (B, H); z: (B, H*P) (views into the in_proj output are fine).
        conv_state: (B, C, K-1); ssm_state: (B, H, P, S) fp32.
        conv_weight: (C, K); conv_bias: (C,) or None; dt_bias, A_log, D: (H,); norm_weight: (H*P,).
    Returns:
        (B, H*P) in z's dtype.
    """
    batch, heads, head_dim, d_state = ssm_state.shape
    channels, kernel_size = conv_weight.shape
    d_inner = heads * head_dim
    if kernel_size < 2:
        raise ValueError("mamba_step needs a conv kernel of width >= 2")
    if ssm_state.dtype != torch.float32:
        raise ValueError(f"mamba_step: the SSM state must be fp32, got {ssm_state.dtype}")
    if tuple(xBC.shape) != (batch, channels) or channels != d_inner + 2 * n_groups * d_state:
        raise ValueError(f"mamba_step: xBC {tuple(xBC.shape)} does not match the state {tuple(ssm_state.shape)}")
    if tuple(conv_state.shape) != (batch, channels, kernel_size - 1) or tuple(z.shape) != (batch, d_inner):
        raise ValueError(f"mamba_step: conv_state {tuple(conv_state.shape)} / z {tuple(z.shape)} do not match")
    gated = torch.empty(batch, d_inner, device=z.device, dtype=torch.float32)
    out = torch.empty(batch, d_inner, device=z.device, dtype=z.dtype)
    _step_ssm_kernel[(batch, heads)](
        xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias if conv_bias is not None else conv_weight,
        dt_bias, A_log, D, gated,
        heads, head_dim, d_state, n_groups, heads // n_groups, float(dt_min), float(dt_max),
        *xBC.stride(), *dt_raw.stride(), *z.stride(), *conv_state.stride(), *ssm_state.stride(),
        *conv_weight.stride(), gated.stride(0),
        K=kernel_size, HAS_BIAS=conv_bias is not None,
        BLOCK_P=max(16, triton.next_power_of_2(head_dim)), BLOCK_S=max(16, triton.next_power_of_2(d_state)),
        num_warps=4,
    )
    group_size = d_inner // norm_groups
    _gated_norm_kernel[(batch, norm_groups)](
        gated, norm_weight, out, xBC, conv_state,
        group_size, d_inner, d_state, n_groups, float(eps),
        gated.stride(0), out.stride(0), *xBC.stride(), *conv_state.stride(),
        K=kernel_size, BLOCK=min(2048, triton.next_power_of_2(group_size)),
        BLOCK_S=max(16, triton.next_power_of_2(d_state)), num_warps=8,
    )
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, sxr, sor, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * sxr + offs, mask=offs < D, other=0.0).to(tl.float32)
        sq += v * v
    r = tl.rsqrt(tl.sum(sq, axis=0) / D + eps)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < D
        v = tl.load(x_ptr + row * sxr + offs, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * sor + offs, (w * (v * r)).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in one launch (inference only: no backward). h (..., D) -> (..., D)."""
    dim = h.shape[-1]
    rows = h.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, device=h.device, dtype=h.dtype)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, dim, float(eps), rows.stride(0), out.stride(0),
            BLOCK=min(4096, triton.next_power_of_2(dim)), num_warps=8,
        )
    return out.reshape(h.shape)
