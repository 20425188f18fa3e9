"""Triton kernels of activation replay (conv state and SSM state); `naive.py` is the spec.

Both read the accepted length from device memory and loop over it inside the kernel, so a
whole speculative iteration can be captured in a CUDA graph with no host sync. Both update the
states in place: each program owns a disjoint slice of the state and reads all of it before it
writes any of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import gdc_launch_dependents, gdc_wait
from ..step_update.triton import _pdl_args


@triton.jit
def _replay_ssm_kernel(
    h_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, path_ptr, len_ptr,
    H, P, S, M, heads_per_group,
    shb, shh, shp, shs,
    sxb, sxn, sxh, sxp,
    sdb, sdn, sdh,
    sBb, sBn, sBg, sBs,
    spb, spm,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, UNROLL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    g = h // heads_per_group
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.program_id(2) * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_p = offs_p < P
    mask_s = offs_s < S
    mask = mask_p[:, None] & mask_s[None, :]
    h_ptrs = h_ptr + b * shb + h * shh + offs_p[:, None] * shp + offs_s[None, :] * shs
    state = tl.load(h_ptrs, mask=mask, other=0.0)
    A = tl.load(A_ptr + h).to(tl.float32)
    steps = tl.minimum(tl.load(len_ptr + b).to(tl.int32), M)
    if UNROLL > 0:
        # Short paths (a tree's depth + 1): unrolled over the path's full width with the steps
        # past `steps` masked to dt = 0 (no change), so every step's loads are independent of
        # the state and can all be in flight at once instead of one dependent chain per step.
        # (UNROLL = M, so every path entry read here exists; entries past `steps` are valid
        # node indices too, as replay's contract pads paths with node indices.)
        for m in tl.static_range(UNROLL):
            node = tl.load(path_ptr + b * spb + m * spm)
            dt = tl.load(dt_ptr + b * sdb + node * sdn + h * sdh).to(tl.float32)
            dt = tl.where(steps > m, dt, 0.0)
            xv = tl.load(x_ptr + b * sxb + node * sxn + h * sxh + offs_p * sxp, mask=mask_p, other=0.0).to(tl.float32)
            Bv = tl.load(B_ptr + b * sBb + node * sBn + g * sBg + offs_s * sBs, mask=mask_s, other=0.0).to(tl.float32)
            state = state * tl.exp(dt * A) + (dt * xv)[:, None] * Bv[None, :]
    else:
        for m in range(0, steps):
            node = tl.load(path_ptr + b * spb + m * spm)
            dt = tl.load(dt_ptr + b * sdb + node * sdn + h * sdh).to(tl.float32)
            xv = tl.load(x_ptr + b * sxb + node * sxn + h * sxh + offs_p * sxp, mask=mask_p, other=0.0).to(tl.float32)
            Bv = tl.load(B_ptr + b * sBb + node * sBn + g * sBg + offs_s * sBs, mask=mask_s, other=0.0).to(tl.float32)
            state = state * tl.exp(dt * A) + (dt * xv)[:, None] * Bv[None, :]
    tl.debug_barrier()  # small tiles are replicated across threads: all copies read before any write
    tl.store(h_ptrs, state, mask=mask)


def replay_ssm_state(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    path: torch.Tensor,
    path_len: torch.Tensor,
) -> None:
    """Advance the SSM state in place over the first path_len[b] nodes of path[b].

    Same contract as `naive_replay_ssm_state`.

    Args:
        ssm_state: (B, H, P, S) fp32, updated in place.
        x: (B, N, H, P); dt: (B, N, H); B: (B, N, G, S) cached activations of the verified tree.
        A: (H,).
        path: (B, M) int node indices, root first.
        path_len: (B,) int, valid entries of each row of path (read on the device).
    """
    batch, heads, head_dim, d_state = ssm_state.shape
    groups = B.shape[2]
    if ssm_state.dtype != torch.float32:
        raise ValueError(f"replay_ssm_state: the SSM state must be fp32, got {ssm_state.dtype}")
    if x.shape[0] != batch or x.shape[2:] != (heads, head_dim) or B.shape[3] != d_state or heads % groups:
        raise ValueError(
            f"replay_ssm_state: x {tuple(x.shape)} / B {tuple(B.shape)} do not match the state {tuple(ssm_state.shape)}"
        )
    if path.shape[0] != batch or tuple(path_len.shape) != (batch,):
        raise ValueError(f"replay_ssm_state: path {tuple(path.shape)} / path_len {tuple(path_len.shape)} need {batch} rows")
    steps = path.shape[1]
    if steps == 0 or ssm_state.numel() == 0:
        return
    block_p = min(32, triton.next_power_of_2(head_dim))
    block_s = min(64, triton.next_power_of_2(d_state))
    grid = (batch * heads, triton.cdiv(head_dim, block_p), triton.cdiv(d_state, block_s))
    _replay_ssm_kernel[grid](
        ssm_state, x, dt, A, B, path, path_len,
        heads, head_dim, d_state, steps, heads // groups,
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(), *path.stride(),
        BLOCK_P=block_p, BLOCK_S=block_s, UNROLL=steps if steps <= 16 else 0, num_warps=4,
        **_pdl_args(ssm_state.device),
    )


@triton.jit
def _replay_conv_kernel(
    state_ptr, x_ptr, path_ptr, len_ptr,
    CH, M,
    ssb, ssc, ssk,
    sxb, sxn, sxc,
    spb, spm,
    HIST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_t = tl.arange(0, BLOCK_H)
    mask_c = offs_c < CH
    mask_t = offs_t < HIST
    steps = tl.minimum(tl.load(len_ptr + b).to(tl.int32), M)
    # New slot t holds entry steps + t of [old state (HIST), accepted inputs (steps)]. The whole
    # (C, K-1) tile is gathered into registers before the store, so the update can be in place.
    src = steps + offs_t  # (K-1,)
    from_old = mask_t & (src < HIST)
    from_path = mask_t & (src >= HIST)
    node = tl.load(path_ptr + b * spb + (src - HIST) * spm, mask=from_path, other=0)
    ptrs = state_ptr + b * ssb + offs_c[:, None] * ssc
    old = tl.load(ptrs + src[None, :] * ssk, mask=mask_c[:, None] & from_old[None, :], other=0.0)
    fresh = tl.load(x_ptr + b * sxb + node[None, :] * sxn + offs_c[:, None] * sxc,
                    mask=mask_c[:, None] & from_path[None, :], other=0.0)
    new = tl.where(from_old[None, :], old, fresh.to(old.dtype))
    tl.debug_barrier()  # a slot may be read by one thread and written by another
    tl.store(ptrs + offs_t[None, :] * ssk, new, mask=mask_c[:, None] & mask_t[None, :])


def replay_conv_state(conv_state: torch.Tensor, xBC: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor) -> None:
    """Shift the accepted path's pre-conv inputs into the conv state, in place.

    Same contract as `naive_replay_conv_state`.

    Args:
        conv_state: (B, C, K-1) oldest first, updated in place.
        xBC: (B, N, C) pre-conv inputs of the verified tree.
        path: (B, M) int node indices, root first.
        path_len: (B,) int (read on the device).
    """
    batch, channels, history = conv_state.shape
    if xBC.shape[0] != batch or xBC.shape[2] != channels:
        raise ValueError(f"replay_conv_state: xBC {tuple(xBC.shape)} does not match conv_state {tuple(conv_state.shape)}")
    if path.shape[0] != batch or tuple(path_len.shape) != (batch,):
        raise ValueError(f"replay_conv_state: path {tuple(path.shape)} / path_len {tuple(path_len.shape)} need {batch} rows")
    if history == 0 or conv_state.numel() == 0 or path.shape[1] == 0:
        return
    block_c = 256
    grid = (batch, triton.cdiv(channels, block_c))
    _replay_conv_kernel[grid](
        conv_state, xBC, path, path_len,
        channels, path.shape[1],
        *conv_state.stride(), *xBC.stride(), *path.stride(),
        HIST=history, BLOCK_H=triton.next_power_of_2(history), BLOCK_C=block_c, num_warps=4,
        **_pdl_args(conv_state.device),
    )
