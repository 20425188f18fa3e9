"""Triton kernels of the fused single-token Mamba-2 step and of RMSNorm; `naive.py` is the spec.

The reference step runs ~40 tiny torch ops per layer; at batch 1 each is a few microseconds of
launch and tail, which across 64 layers costs more than reading the weights. Here the step is
two launches:

1. `_step_ssm_kernel`, one program per (batch row, head, block of P): the conv update of its x
   channels (whose conv state it owns and shifts), the conv of its group's B and C channels
   (read-only: every head of the group reads them), dt, the (P_blk, S) state update, y, the D skip
   and the gate y * silu(z), written as fp32 (B, H*P).
2. `_gated_norm_kernel`, one program per (batch row, norm group): the RMSNorm over the group and
   the norm weight; it also shifts the conv state of the B and C channels, which could not be
   done in (1) without racing with other heads still reading the old window.

Also here: `add_rms_norm` (a residual add fused into the next sublayer's RMSNorm, used by
`LanguageModel._fused_step` / `_fused_verify`), `mamba_step_out` (the step, out_proj and the
residual add: at batch 1 with the gated norm's weight folded into out_proj, two launches, the
norm inside the out_proj GEMV) and
the one-launch gated RMSNorm and time step of the verify path; the one-launch RMSNorm lives in
ops/triton_common.py (gemv runs it too) and is re-exported here. Every kernel launches with
programmatic dependent launch on Hopper (ops/pdl.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import pdl
from ..gemv import triton as gemv
from ..gemv.triton import gemv_tile
from ..settings import interpreting
from ..triton_common import gdc_launch_dependents, gdc_wait, pdl_args, rms_norm, softplus

__all__ = ["add_rms_norm", "gated_rms_norm", "mamba_step", "mamba_step_out", "rms_norm", "time_step"]


NORM_CHUNK = 512
"""Channels per program of the gated norm, which reads per-block sums of squares written by the
step kernel (n_parts floats) instead of re-reducing the whole group."""


@triton.jit
def _conv_history(state_row, w_ptr, ch, mask_c, in_dtype, scc, sck, swc, swk, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The part of one token's depthwise conv over channels ch that does not need the token: the
    K-1 cached inputs (rounded to the input dtype, as the reference does) times their taps, fp32,
    and the tap of the new input. Returns (partial sum, last tap)."""
    offs_t = tl.arange(0, BLOCK_K)
    m = mask_c[:, None] & (offs_t[None, :] < K - 1)
    old = tl.load(state_row + ch[:, None] * scc + offs_t[None, :] * sck, mask=m, other=0.0)
    w = tl.load(w_ptr + ch[:, None] * swc + offs_t[None, :] * swk, mask=m, other=0.0).to(tl.float32)
    acc = tl.sum(old.to(in_dtype).to(tl.float32) * w, axis=1)
    return acc, tl.load(w_ptr + ch * swc + (K - 1) * swk, mask=mask_c, other=0.0).to(tl.float32)


@triton.jit
def _shift_in(state_row, ch, mask_c, new, scc, sck, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """conv_state[ch] <- [conv_state[ch, 1:], new], in place. The whole shifted tile is read
    before a barrier and written after it: a slot may be read by one thread and written by
    another (small tiles are replicated across threads), so a per-slot loop would race."""
    offs_t = tl.arange(0, BLOCK_K)
    nxt = tl.load(state_row + ch[:, None] * scc + (offs_t[None, :] + 1) * sck,
                  mask=mask_c[:, None] & (offs_t[None, :] + 1 < K - 1), other=0.0)
    nxt = tl.where(offs_t[None, :] == K - 2, new[:, None].to(nxt.dtype), nxt)
    tl.debug_barrier()
    tl.store(state_row + ch[:, None] * scc + offs_t[None, :] * sck, nxt, mask=mask_c[:, None] & (offs_t[None, :] < K - 1))


@triton.jit
def _step_ssm_kernel(
    xbc_ptr, dtr_ptr, z_ptr, cs_ptr, h_ptr, cw_ptr, cb_ptr, dtb_ptr, Alog_ptr, D_ptr, g_ptr, sq_ptr,
    H, P, S, G, heads_per_group, dt_min, dt_max,
    sxb, sxc, sdb, sdh, szb, szc,
    scb, scc, sck,
    shb, shh, shp, shs,
    swc, swk,
    sgb,
    K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    WRITE_SQ: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now
        gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // heads_per_group
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    mask_p = offs_p < P
    mask_s = offs_s < S
    d_inner = H * P
    cx = h * P + offs_p  # this program's x channels
    cB = d_inner + grp * S + offs_s
    cC = d_inner + G * S + grp * S + offs_s

    # Everything that does not depend on in_proj is read before the PDL wait: the
    # (P_blk, S) state, the conv history and taps, the conv bias, dt_bias, A and D. The state and
    # the conv history were last written by this kernel and out_proj's kernel in the previous
    # step (or by replay), and every step begins with the embedding lookup, a plain (non-PDL)
    # launch that waits for all earlier work, so they are final here.
    h_ptrs = h_ptr + b * shb + h * shh + offs_p[:, None] * shp + offs_s[None, :] * shs
    mask_ps = mask_p[:, None] & mask_s[None, :]
    state = tl.load(h_ptrs, mask=mask_ps, other=0.0)
    state_row = cs_ptr + b * scb
    in_dtype = xbc_ptr.dtype.element_ty
    # B and C: every program of the group convolves them from the old window (cheap, 2S
    # channels); their conv-state shift is left to the next kernel (_gated_norm_kernel or
    # _step_out_kernel), which runs after all readers are done.
    acc_x, wx = _conv_history(state_row, cw_ptr, cx, mask_p, in_dtype, scc, sck, swc, swk, K, BLOCK_K)
    acc_B, wB = _conv_history(state_row, cw_ptr, cB, mask_s, in_dtype, scc, sck, swc, swk, K, BLOCK_K)
    acc_C, wC = _conv_history(state_row, cw_ptr, cC, mask_s, in_dtype, scc, sck, swc, swk, K, BLOCK_K)
    if HAS_BIAS:
        acc_x += tl.load(cb_ptr + cx, mask=mask_p, other=0.0).to(tl.float32)
        acc_B += tl.load(cb_ptr + cB, mask=mask_s, other=0.0).to(tl.float32)
        acc_C += tl.load(cb_ptr + cC, mask=mask_s, other=0.0).to(tl.float32)
    dt_b = tl.load(dtb_ptr + h).to(tl.float32)
    A = -tl.exp(tl.load(Alog_ptr + h).to(tl.float32))
    D = tl.load(D_ptr + h).to(tl.float32)
    if USE_PDL:
        gdc_wait()

    new_x = tl.load(xbc_ptr + b * sxb + cx * sxc, mask=mask_p, other=0.0)
    new_B = tl.load(xbc_ptr + b * sxb + cB * sxc, mask=mask_s, other=0.0)
    new_C = tl.load(xbc_ptr + b * sxb + cC * sxc, mask=mask_s, other=0.0)
    acc_x += new_x.to(tl.float32) * wx
    acc_B += new_B.to(tl.float32) * wB
    acc_C += new_C.to(tl.float32) * wC
    # silu, then round to the input dtype as the reference's conv output is.
    x = (acc_x * tl.sigmoid(acc_x)).to(in_dtype).to(tl.float32)
    Bv = (acc_B * tl.sigmoid(acc_B)).to(in_dtype).to(tl.float32)
    Cv = (acc_C * tl.sigmoid(acc_C)).to(in_dtype).to(tl.float32)

    dt = softplus(tl.load(dtr_ptr + b * sdb + h * sdh).to(tl.float32) + dt_b)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    state = state * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
    y = tl.sum(state * Cv[None, :], axis=1) + x * D
    zv = tl.load(z_ptr + b * szb + cx * szc, mask=mask_p, other=0.0).to(tl.float32)
    out_dtype = z_ptr.dtype.element_ty
    gated = y.to(out_dtype).to(tl.float32) * (zv * tl.sigmoid(zv))
    tl.store(g_ptr + b * sgb + cx, gated, mask=mask_p)
    if WRITE_SQ:  # this block's sum of squares, for the gated norm kernel
        tl.store(sq_ptr + (b * H + h) * tl.num_programs(2) + tl.program_id(2),
                 tl.sum(tl.where(mask_p, gated * gated, 0.0), axis=0))
    # In-place writes last; the barrier in _shift_in also orders every replicated copy of the
    # state tile's loads before these stores.
    _shift_in(state_row, cx, mask_p, new_x, scc, sck, K, BLOCK_K)  # this program owns these x channels
    tl.store(h_ptrs, state, mask=mask_ps)


@triton.jit
def _gated_norm_kernel(
    g_ptr, w_ptr, out_ptr, xbc_ptr, cs_ptr,
    group_size, d_inner, S, G, eps,
    sgb, sob, sxb, sxc, scb, scc, sck,
    K: tl.constexpr, BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    sq_ptr=None, n_parts=0, parts_per_head=1, head_dim=1,
    FROM_PARTS: tl.constexpr = False, BLOCK_Q: tl.constexpr = 16, BLOCK_PB: tl.constexpr = 16,
    HAS_W: tl.constexpr = True,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    # grid (B, norm groups, chunks): every program reduces its whole group (L2-resident, one
    # wide load) and normalises only its own chunk, so the launch is one short pass instead of
    # one long serial program per group. FROM_PARTS: the group's sum of squares from the step
    # kernel's per-block sums instead (n_parts floats rather than the group's values).
    b = tl.program_id(0)
    ng = tl.program_id(1)
    chunk = tl.program_id(2)
    base = ng * group_size
    if FROM_PARTS:
        offs_q = tl.arange(0, BLOCK_Q)
        part = tl.load(sq_ptr + b * n_parts + offs_q, mask=offs_q < n_parts, other=0.0)
        q_group = ((offs_q // parts_per_head) * head_dim + (offs_q % parts_per_head) * BLOCK_PB) // group_size
        total = tl.sum(tl.where((q_group == ng) & (offs_q < n_parts), part, 0.0), axis=0)
    else:
        sq = tl.zeros([BLOCK_R], dtype=tl.float32)
        for start in range(0, group_size, BLOCK_R):
            offs = start + tl.arange(0, BLOCK_R)
            v = tl.load(g_ptr + b * sgb + base + offs, mask=offs < group_size, other=0.0)
            sq += v * v
        total = tl.sum(sq, axis=0)
    r = tl.rsqrt(total / group_size + eps)
    out_dtype = out_ptr.dtype.element_ty
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    m = offs < group_size
    v = tl.load(g_ptr + b * sgb + base + offs, mask=m, other=0.0)
    out = (v * r).to(out_dtype)
    if HAS_W:
        out = (tl.load(w_ptr + base + offs, mask=m, other=0.0).to(tl.float32) * out.to(tl.float32)).to(out_dtype)
    tl.store(out_ptr + b * sob + base + offs, out, mask=m)

    # The deferred conv-state shift of the B and C channels (see the module docstring), done by
    # the chunk-0 programs: norm group ng shifts B/C groups ng, ng + NG, ... exactly once each.
    if chunk == 0:
        NG = tl.num_programs(1)
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = offs_s < S
        state_row = cs_ptr + b * scb
        for grp in range(ng, G, NG):
            for which in tl.static_range(2):
                ch = d_inner + which * G * S + grp * S + offs_s
                new = tl.load(xbc_ptr + b * sxb + ch * sxc, mask=mask_s, other=0.0)
                _shift_in(state_row, ch, mask_s, new, scc, sck, K, BLOCK_K)


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
    norm_weight: torch.Tensor | None,
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
        conv_weight: (C, K); conv_bias: (C,) or None; dt_bias, A_log, D: (H,); norm_weight: (H*P,), or
            None for a norm without weight (folded into out_proj).
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
    block_p = 16
    group_size = d_inner // norm_groups
    from_parts = head_dim % block_p == 0 and group_size % block_p == 0
    parts_per_head = triton.cdiv(head_dim, block_p)
    n_parts = heads * parts_per_head
    sq = torch.empty(batch, n_parts, device=z.device, dtype=torch.float32) if from_parts else gated
    block_k = max(2, triton.next_power_of_2(kernel_size - 1))
    # (batch, head, block of P): 4 programs per head at P = 64 keeps every SM busy at batch 1.
    _step_ssm_kernel[(batch, heads, triton.cdiv(head_dim, block_p))](
        xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias if conv_bias is not None else conv_weight,
        dt_bias, A_log, D, gated, sq,
        heads, head_dim, d_state, n_groups, heads // n_groups, float(dt_min), float(dt_max),
        *xBC.stride(), *dt_raw.stride(), *z.stride(), *conv_state.stride(), *ssm_state.stride(),
        *conv_weight.stride(), gated.stride(0),
        K=kernel_size, HAS_BIAS=conv_bias is not None,
        BLOCK_P=block_p, BLOCK_S=max(16, triton.next_power_of_2(d_state)), BLOCK_K=block_k, WRITE_SQ=from_parts,
        num_warps=4, **pdl_args(z.device),
    )
    chunk = min(NORM_CHUNK if from_parts else 1024, triton.next_power_of_2(group_size))
    _gated_norm_kernel[(batch, norm_groups, triton.cdiv(group_size, chunk))](
        gated, norm_weight if norm_weight is not None else gated, out, xBC, conv_state,
        group_size, d_inner, d_state, n_groups, float(eps),
        gated.stride(0), out.stride(0), *xBC.stride(), *conv_state.stride(),
        K=kernel_size, BLOCK_R=min(8192, triton.next_power_of_2(group_size)), CHUNK=chunk,
        BLOCK_S=max(16, triton.next_power_of_2(d_state)), BLOCK_K=block_k,
        sq_ptr=sq, n_parts=n_parts, parts_per_head=parts_per_head, head_dim=head_dim, FROM_PARTS=from_parts,
        BLOCK_Q=max(16, triton.next_power_of_2(n_parts)), BLOCK_PB=block_p, HAS_W=norm_weight is not None,
        num_warps=4 if from_parts else 8, **pdl_args(z.device),
    )
    return out


@triton.jit
def _gated_rms_norm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, D, group_size, eps, syr, szr, sor,
                           BLOCK_R: tl.constexpr, CHUNK: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    # grid (rows, groups, chunks): each program reduces the whole group, writes its chunk.
    row = tl.program_id(0)
    base = tl.program_id(1) * group_size
    in_dtype = z_ptr.dtype.element_ty  # y is rounded to z's dtype first, as the reference does
    sq = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, group_size, BLOCK_R):
        offs = start + tl.arange(0, BLOCK_R)
        m = offs < group_size
        y = tl.load(y_ptr + row * syr + base + offs, mask=m, other=0.0).to(in_dtype).to(tl.float32)
        z = tl.load(z_ptr + row * szr + base + offs, mask=m, other=0.0).to(tl.float32)
        g = y * z * tl.sigmoid(z)
        sq += g * g
    r = tl.rsqrt(tl.sum(sq, axis=0) / group_size + eps)
    offs = tl.program_id(2) * CHUNK + tl.arange(0, CHUNK)
    m = offs < group_size
    y = tl.load(y_ptr + row * syr + base + offs, mask=m, other=0.0).to(in_dtype).to(tl.float32)
    z = tl.load(z_ptr + row * szr + base + offs, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + base + offs, mask=m, other=0.0).to(tl.float32)
    normed = (y * z * tl.sigmoid(z) * r).to(in_dtype).to(tl.float32)  # the reference rounds here
    tl.store(out_ptr + row * sor + base + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=m)


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int, eps: float) -> torch.Tensor:
    """RMSNorm of y * silu(z) over groups of channels in one launch (inference only).

    Same contract as `naive_gated_rms_norm`: y (..., H*P) any float dtype, rounded to z's dtype
    first; z (..., H*P); weight (H*P,).
    """
    dim = y.shape[-1]
    if dim % group_size or tuple(z.shape) != tuple(y.shape):
        raise ValueError(f"gated_rms_norm: y {tuple(y.shape)} / z {tuple(z.shape)} / group size {group_size} do not match")
    y2 = y.reshape(-1, dim)
    z2 = z.reshape(-1, dim)
    if y2.stride(-1) != 1:
        y2 = y2.contiguous()
    if z2.stride(-1) != 1:
        z2 = z2.contiguous()
    out = torch.empty(y2.shape, device=y.device, dtype=torch.result_type(weight, z))
    if y2.shape[0]:
        chunk = min(1024, triton.next_power_of_2(group_size))
        _gated_rms_norm_kernel[(y2.shape[0], dim // group_size, triton.cdiv(group_size, chunk))](
            y2, z2, weight, out, dim, group_size, float(eps), y2.stride(0), z2.stride(0), out.stride(0),
            BLOCK_R=min(8192, triton.next_power_of_2(group_size)), CHUNK=chunk, num_warps=8, **pdl_args(y.device),
        )
    return out.reshape(y.shape)


@triton.jit
def _time_step_kernel(dt_ptr, bias_ptr, out_ptr, rows, H, sdr, dt_min, dt_max, BLOCK_R: tl.constexpr,
                      BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_H)
    m = (offs_r < rows)[:, None] & (offs_h < H)[None, :]
    v = tl.load(dt_ptr + offs_r[:, None] * sdr + offs_h[None, :], mask=m, other=0.0).to(tl.float32)
    v += tl.load(bias_ptr + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_r[:, None] * H + offs_h[None, :], tl.minimum(tl.maximum(softplus(v), dt_min), dt_max), mask=m)


def time_step(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    """softplus(dt_raw + dt_bias) clamped, fp32, in one launch. dt_raw (..., H) -> (..., H).

    dt_raw may be a column slice of the in_proj output (rows strided): it is read in place
    rather than copied (a copy was a launch per layer of its own)."""
    heads = dt_raw.shape[-1]
    rows2d = dt_raw.reshape(-1, heads)
    if rows2d.stride(-1) != 1:
        rows2d = rows2d.contiguous()
    out = torch.empty(dt_raw.shape, device=dt_raw.device, dtype=torch.float32)
    rows = rows2d.shape[0]
    if rows:
        block_h = triton.next_power_of_2(heads)
        block_r = max(1, 1024 // block_h)
        _time_step_kernel[(triton.cdiv(rows, block_r),)](
            rows2d, dt_bias, out, rows, heads, rows2d.stride(0), float(dt_min), float(dt_max),
            BLOCK_R=block_r, BLOCK_H=block_h, **pdl_args(dt_raw.device),
        )
    return out


@triton.jit
def _add_rms_norm_kernel(d_ptr, h_ptr, w_ptr, hout_ptr, out_ptr, D, eps, sdr, sds, shr, shor, sor,
                         SPLIT: tl.constexpr, ROUND: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    # one program per row; the row fits one block, so the sum is stored once and normalised from registers
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < D
    h_dtype = h_ptr.dtype.element_ty
    d = tl.load(d_ptr + row * sdr + offs, mask=m, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLIT):
        d += tl.load(d_ptr + s * sds + row * sdr + offs, mask=m, other=0.0)
    if ROUND:  # partial sums: round as the projection's own output would be
        d = d.to(h_dtype).to(tl.float32)
    hv = tl.load(h_ptr + row * shr + offs, mask=m, other=0.0).to(tl.float32)
    s_new = (hv + d).to(h_dtype)  # torch's h + x in h's dtype
    tl.store(hout_ptr + row * shor + offs, s_new, mask=m)
    sf = s_new.to(tl.float32)
    r = tl.rsqrt(tl.sum(sf * sf, axis=0) / D + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * sor + offs, (w * (sf * r)).to(out_ptr.dtype.element_ty), mask=m)


ADD_RMS_NORM_MAX_DIM = 16384
"""Rows up to this width fit one program's registers; the model falls back to add + rms_norm above."""


def add_rms_norm(delta: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float):
    """h + delta and the RMSNorm of the sum in one launch (inference only); same contract as
    `naive_add_rms_norm`: delta (..., D) or fp32 partials (SPLIT, ..., D); h (..., D).
    Returns (h + delta, normed), both new tensors in h's dtype."""
    dim = h.shape[-1]
    if dim > ADD_RMS_NORM_MAX_DIM:
        raise ValueError(f"add_rms_norm: width {dim} > {ADD_RMS_NORM_MAX_DIM}")
    partial = delta.dim() == h.dim() + 1
    split = delta.shape[0] if partial else 1
    if tuple(delta.shape[partial:]) != tuple(h.shape):
        raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} does not match h {tuple(h.shape)}")
    h2 = h.reshape(-1, dim)
    d2 = delta.reshape(split, -1, dim)
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    if d2.stride(-1) != 1:
        d2 = d2.contiguous()
    h_out = torch.empty(h2.shape, device=h.device, dtype=h.dtype)
    out = torch.empty(h2.shape, device=h.device, dtype=h.dtype)
    if h2.shape[0]:
        _add_rms_norm_kernel[(h2.shape[0],)](
            d2, h2, weight, h_out, out, dim, float(eps), d2.stride(1), d2.stride(0), h2.stride(0), h_out.stride(0),
            out.stride(0), SPLIT=split, ROUND=partial, BLOCK=triton.next_power_of_2(dim),
            num_warps=4 if dim <= 4096 else 8, **pdl_args(h.device),
        )
    return h_out.reshape(h.shape), out.reshape(h.shape)


@triton.jit
def _step_out_kernel(
    g_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, xbc_ptr, cs_ptr,
    N, K, swn, group_size, eps, d_inner, S, G, sxc, scc, sck,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM_GROUPS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr, UNROLL: tl.constexpr, PRELOAD: tl.constexpr,
    K_CONV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_KC: tl.constexpr, USE_PDL: tl.constexpr,
    GROUPED: tl.constexpr = False, BLOCK_K2: tl.constexpr = 0,
):
    """out_proj of one row (batch 1) whose input is the gated value g of `_step_ssm_kernel`: the
    gated RMSNorm runs in the GEMV's prologue (its weight folded into out_proj's, see
    ops/gemv `norm_linear`) and the residual add in its epilogue. Program 0 also does the step's
    deferred conv-state shift of the B and C channels (see the module docstring): after the GEMV
    tile's wait every step-kernel program that read the old window is done."""
    if USE_PDL:
        gdc_launch_dependents()
    gemv_tile(g_ptr, w_ptr, bias_ptr, y_ptr, tl.program_id(0), 0, N, K, swn, HAS_BIAS, False, BLOCK_N, BLOCK_K,
               K_SPLIT, UNROLL, PRELOAD, USE_PDL, res_ptr, group_size, eps, NORM_GROUPS, HAS_RES, BLOCK_G, GROUPED,
               BLOCK_K2)
    if tl.program_id(0) == 0:
        offs_s = tl.arange(0, BLOCK_S)
        mask_s = offs_s < S
        for grp in range(0, G):
            for which in tl.static_range(2):
                ch = d_inner + which * G * S + grp * S + offs_s
                new = tl.load(xbc_ptr + ch * sxc, mask=mask_s, other=0.0)
                _shift_in(cs_ptr, ch, mask_s, new, scc, sck, K_CONV, BLOCK_KC)


def mamba_step_out(
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
    out_weight: torch.Tensor,
    out_bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`mamba_step`, out_proj and the residual add; same contract as `naive_mamba_step_out`.

    With the gated norm's weight folded into out_weight (norm_weight None) at batch 1: two
    launches, the step kernel (writing the gated value in z's dtype) and an out_proj GEMV that
    normalises its input itself and adds the residual. Otherwise `mamba_step`, `gemv.linear` and
    a torch add.

    Returns: (B, d_model), in residual's dtype when given, else z's.
    """
    batch, heads, head_dim, d_state = ssm_state.shape
    channels, kernel_size = conv_weight.shape
    d_inner = heads * head_dim
    fused = (norm_weight is None and batch == 1 and out_weight.stride(-1) == 1 and d_inner % norm_groups == 0
             and tuple(out_weight.shape[1:]) == (d_inner,)
             and (z.device.type == "cuda" or interpreting()))
    if not fused:
        out = gemv.linear(mamba_step(xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                                norm_weight, n_groups, norm_groups, dt_min, dt_max, eps), out_weight, out_bias)
        return out if residual is None else residual + out.to(residual.dtype)
    if kernel_size < 2 or ssm_state.dtype != torch.float32 or tuple(xBC.shape) != (batch, channels) \
            or channels != d_inner + 2 * n_groups * d_state or tuple(z.shape) != (batch, d_inner) \
            or tuple(conv_state.shape) != (batch, channels, kernel_size - 1):
        raise ValueError(f"mamba_step_out: shapes do not match (xBC {tuple(xBC.shape)}, state {tuple(ssm_state.shape)})")
    n_out = out_weight.shape[0]
    if residual is not None and residual.numel() != n_out:
        raise ValueError(f"mamba_step_out: residual {tuple(residual.shape)} does not match out_proj ({n_out})")
    block_p = 16  # 8 and 32 channels per program, or 2 warps, measured no faster on an H100
    gated = torch.empty(batch, d_inner, device=z.device, dtype=z.dtype)  # rounded: the GEMV reads half the bytes
    block_k = max(2, triton.next_power_of_2(kernel_size - 1))
    block_s = max(16, triton.next_power_of_2(d_state))
    _step_ssm_kernel[(batch, heads, triton.cdiv(head_dim, block_p))](
        xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias if conv_bias is not None else conv_weight,
        dt_bias, A_log, D, gated, gated,
        heads, head_dim, d_state, n_groups, heads // n_groups, float(dt_min), float(dt_max),
        *xBC.stride(), *dt_raw.stride(), *z.stride(), *conv_state.stride(), *ssm_state.stride(),
        *conv_weight.stride(), gated.stride(0),
        K=kernel_size, HAS_BIAS=conv_bias is not None,
        BLOCK_P=block_p, BLOCK_S=block_s, BLOCK_K=block_k, WRITE_SQ=False,
        num_warps=4, **pdl_args(z.device),
    )
    return _launch_out_proj(gated, xBC, conv_state, out_weight, out_bias, residual, norm_groups, eps, n_groups,
                            d_state, kernel_size)


def _launch_out_proj(gated, xBC, conv_state, out_weight, out_bias, residual, norm_groups, eps, n_groups, d_state,
                     kernel_size):
    """`_step_out_kernel` for one row: out_proj of the gated value with the gated norm and the
    residual add inside, and the deferred B/C conv-state shift."""
    n_out, d_inner = out_weight.shape
    y = torch.empty(1, n_out, device=gated.device,
                    dtype=torch.result_type(gated, out_weight) if residual is None else residual.dtype)
    block_n, cfg_k, warps, split, _, unroll, preload = gemv.GemvConfig(*gemv.gemv_config(n_out, d_inner, gated.device))
    cfg_k2 = 0
    if preload:
        cfg_k, cfg_k2 = gemv.preload_blocks(d_inner, 1, norm_groups)
        k_split = cfg_k + cfg_k2
    else:
        cfg_k = min(cfg_k, triton.next_power_of_2(d_inner))
        k_split = triton.cdiv(d_inner, cfg_k) * cfg_k
    use_pdl = pdl.enabled(gated.device)
    _step_out_kernel[(triton.cdiv(n_out, block_n),)](
        gated, out_weight, out_bias if out_bias is not None else out_weight,
        residual.reshape(n_out) if residual is not None else None, y, xBC, conv_state,
        n_out, d_inner, out_weight.stride(0), d_inner // norm_groups, float(eps), d_inner, d_state, n_groups,
        xBC.stride(-1), conv_state.stride(1), conv_state.stride(2),
        HAS_BIAS=out_bias is not None, HAS_RES=residual is not None, NORM_GROUPS=norm_groups,
        BLOCK_G=triton.next_power_of_2(norm_groups), BLOCK_N=block_n, BLOCK_K=cfg_k, K_SPLIT=k_split,
        UNROLL=bool(unroll), PRELOAD=bool(preload), K_CONV=kernel_size, BLOCK_S=max(16, triton.next_power_of_2(d_state)),
        BLOCK_KC=max(2, triton.next_power_of_2(kernel_size - 1)),
        USE_PDL=use_pdl, GROUPED=bool(preload) and gemv.grouped_epilogue(d_inner, cfg_k, norm_groups), BLOCK_K2=cfg_k2,
        num_warps=warps, **({"launch_pdl": True} if use_pdl else {}),
    )
    return y

