"""Triton kernels of activation replay (conv state and SSM state); `naive.py` is the spec.

`replay_states` runs both updates in one launch (the verify path's replay of a Mamba layer):
its 1-D grid's first programs are the SSM tiles, the rest the conv-state channel blocks.
`replay_states_layers` does the same for every Mamba layer of a model in one launch: the layer
is the grid's second dimension and each layer's tensors come from a table of base addresses
(a model's Mamba layers share shapes and strides, so one set of strides serves all of them).

All read the accepted length from device memory and loop over it inside the kernel, so a
whole speculative iteration can be captured in a CUDA graph with no host sync. All update the
states in place: each program owns a disjoint slice of the state and reads all of it before it
writes any of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..graph_tables import device_table
from ..triton_common import gdc_launch_dependents, gdc_wait, pdl_args
from .naive import layer_arguments, pending_per_layer


@triton.jit
def _advance_over_path(
    state, A, x_base, dt_base, B_base, path_ptr, spm, count,
    sxn, sxp, sdn, sBn, sBs, offs_p, offs_s, mask_p, mask_s,
    UNROLL: tl.constexpr,
):
    # The state tile advanced over the first `count` nodes of the path. In chunks of UNROLL
    # steps, unrolled, with the steps past `count` masked to dt = 0 (no change): a chunk's loads
    # are independent of the state and can all be in flight at once instead of one dependent
    # chain per step. Masked steps read node 0, which always exists.
    for m0 in range(0, count, UNROLL):
        for i in tl.static_range(UNROLL):
            live = m0 + i < count
            row = tl.load(path_ptr + (m0 + i) * spm, mask=live, other=0)
            dt = tl.load(dt_base + row * sdn, mask=live, other=0.0).to(tl.float32)
            xv = tl.load(x_base + row * sxn + offs_p * sxp, mask=mask_p, other=0.0).to(tl.float32)
            Bv = tl.load(B_base + row * sBn + offs_s * sBs, mask=mask_s, other=0.0).to(tl.float32)
            state = state * tl.exp(dt * A) + (dt * xv)[:, None] * Bv[None, :]
    return state


@triton.jit
def _replay_ssm_tile(
    h_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, path_ptr, len_ptr,
    b, h, pid_p, pid_s,
    P, S, M, heads_per_group,
    shb, shh, shp, shs,
    sxb, sxn, sxh, sxp,
    sdb, sdn, sdh,
    sBb, sBn, sBg, sBs,
    spb, spm,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, UNROLL: tl.constexpr,
    px_ptr=None, pdt_ptr=None, pB_ptr=None, count_ptr=None, L=0, FORCE=0,
    spxb=0, spxl=0, spxh=0, spxp=0, spdb=0, spdl=0, spdh=0, spBb=0, spBl=0, spBg=0, spBs=0,
    HAS_PENDING: tl.constexpr = False, BLOCK_L: tl.constexpr = 16,
):
    # One (BLOCK_P, BLOCK_S) tile of the state of (batch row b, head h), advanced over the path.
    # With pending inputs (HAS_PENDING; naive.py's naive_replay_ssm_deferred) the tile does
    # nothing unless the row flushes: then it advances the state over the pending slots (one
    # product over BLOCK_L >= L slots) and then the path. The conv-block programs append.
    g = h // heads_per_group
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_p = offs_p < P
    mask_s = offs_s < S
    mask = mask_p[:, None] & mask_s[None, :]
    h_ptrs = h_ptr + b * shb + h * shh + offs_p[:, None] * shp + offs_s[None, :] * shs
    A = tl.load(A_ptr + h).to(tl.float32)
    steps = tl.minimum(tl.load(len_ptr + b).to(tl.int32), M)
    x_base = x_ptr + b * sxb + h * sxh
    dt_base = dt_ptr + b * sdb + h * sdh
    B_base = B_ptr + b * sBb + g * sBg
    if HAS_PENDING:
        count = tl.load(count_ptr + b).to(tl.int32)
        if (count + steps + M > L) | (FORCE != 0):  # flush: the pending slots, then the path
            state = tl.load(h_ptrs, mask=mask, other=0.0)
            # The slots in one product: state <- exp(sum a) state + (x^T w) B over the valid
            # slots, w_j = dt_j exp(sum_{k>j} a_k), on the tensor cores in three TF32 passes
            # (about fp32's accuracy: the state keeps it).
            offs_l = tl.arange(0, BLOCK_L)
            mask_l = offs_l < count
            pdt = tl.load(pdt_ptr + b * spdb + offs_l * spdl + h * spdh, mask=mask_l, other=0.0).to(tl.float32)
            px = tl.load(px_ptr + b * spxb + offs_l[:, None] * spxl + h * spxh + offs_p[None, :] * spxp,
                         mask=mask_l[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
            pB = tl.load(pB_ptr + b * spBb + offs_l[:, None] * spBl + g * spBg + offs_s[None, :] * spBs,
                         mask=mask_l[:, None] & mask_s[None, :], other=0.0).to(tl.float32)
            p_log = pdt * A
            p_total = tl.sum(p_log, axis=0)
            p_w = pdt * tl.exp(p_total - tl.cumsum(p_log, axis=0))
            state = state * tl.exp(p_total) + tl.dot(tl.trans(px * p_w[:, None]), pB, input_precision="tf32x3")
            state = _advance_over_path(
                state, A, x_base, dt_base, B_base, path_ptr + b * spb, spm, steps,
                sxn, sxp, sdn, sBn, sBs, offs_p, offs_s, mask_p, mask_s, UNROLL,
            )
            tl.debug_barrier()  # small tiles are replicated across threads: all copies read before any write
            tl.store(h_ptrs, state, mask=mask)
    else:
        state = tl.load(h_ptrs, mask=mask, other=0.0)
        state = _advance_over_path(
            state, A, x_base, dt_base, B_base, path_ptr + b * spb, spm, steps,
            sxn, sxp, sdn, sBn, sBs, offs_p, offs_s, mask_p, mask_s, UNROLL,
        )
        tl.debug_barrier()  # small tiles are replicated across threads: all copies read before any write
        tl.store(h_ptrs, state, mask=mask)


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
    _replay_ssm_tile(
        h_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, path_ptr, len_ptr,
        pid_bh // H, pid_bh % H, tl.program_id(1), tl.program_id(2),
        P, S, M, heads_per_group,
        shb, shh, shp, shs, sxb, sxn, sxh, sxp, sdb, sdn, sdh, sBb, sBn, sBg, sBs, spb, spm,
        BLOCK_P, BLOCK_S, UNROLL,
    )


def _check_ssm_replay(op, ssm_state, x, B, path, path_len):
    batch, heads, head_dim, d_state = ssm_state.shape
    if ssm_state.dtype != torch.float32:
        raise ValueError(f"{op}: the SSM state must be fp32, got {ssm_state.dtype}")
    if x.shape[0] != batch or x.shape[2:] != (heads, head_dim) or B.shape[3] != d_state or heads % B.shape[2]:
        raise ValueError(f"{op}: x {tuple(x.shape)} / B {tuple(B.shape)} do not match the state {tuple(ssm_state.shape)}")
    if path.shape[0] != batch or tuple(path_len.shape) != (batch,):
        raise ValueError(f"{op}: path {tuple(path.shape)} / path_len {tuple(path_len.shape)} need {batch} rows")


def _check_conv_replay(op, conv_state, xBC, path, path_len):
    batch, channels, _ = conv_state.shape
    if xBC.shape[0] != batch or xBC.shape[2] != channels:
        raise ValueError(f"{op}: xBC {tuple(xBC.shape)} does not match conv_state {tuple(conv_state.shape)}")
    if path.shape[0] != batch or tuple(path_len.shape) != (batch,):
        raise ValueError(f"{op}: path {tuple(path.shape)} / path_len {tuple(path_len.shape)} need {batch} rows")


def _ssm_blocks(head_dim: int, d_state: int, steps: int, pending: bool = False) -> dict:
    """Tile sizes of the SSM replay; the path runs in unrolled chunks of up to 16 steps (see _replay_ssm_tile).
    With pending slots at least 16 x 16: the flush's product runs on tl.dot."""
    low = 16 if pending else 1
    return {"BLOCK_P": max(low, min(32, triton.next_power_of_2(head_dim))),
            "BLOCK_S": max(low, min(64, triton.next_power_of_2(d_state))), "UNROLL": min(steps, 16)}


_CONV_BLOCK = 256


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
    _check_ssm_replay("replay_ssm_state", ssm_state, x, B, path, path_len)
    batch, heads, head_dim, d_state = ssm_state.shape
    steps = path.shape[1]
    if steps == 0 or ssm_state.numel() == 0:
        return
    blocks = _ssm_blocks(head_dim, d_state, steps)
    grid = (batch * heads, triton.cdiv(head_dim, blocks["BLOCK_P"]), triton.cdiv(d_state, blocks["BLOCK_S"]))
    _replay_ssm_kernel[grid](
        ssm_state, x, dt, A, B, path, path_len,
        heads, head_dim, d_state, steps, heads // B.shape[2],
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(), *path.stride(),
        **blocks, num_warps=4, **pdl_args(ssm_state.device),
    )


@triton.jit
def _replay_conv_tile(
    state_ptr, x_ptr, path_ptr, len_ptr,
    b, pid_c,
    CH, M,
    ssb, ssc, ssk,
    sxb, sxn, sxc,
    spb, spm,
    HIST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # BLOCK_C channels of batch row b's conv state, shifted over the path.
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
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


@triton.jit
def _append_pending_tile(
    x_ptr, dt_ptr, B_ptr, path_ptr, len_ptr, b, pid_c, M, H, P, S, heads_per_group,
    sxb, sxn, sxh, sxp, sdb, sdn, sdh, sBb, sBn, sBg, sBs, spb, spm,
    px_ptr, pdt_ptr, pB_ptr, count_ptr, L, FORCE,
    spxb, spxl, spxh, spxp, spdb, spdl, spdh, spBb, spBl, spBg, spBs,
    BLOCK_C: tl.constexpr, BLOCK_HD: tl.constexpr, UNROLL: tl.constexpr,
):
    # The pending half of a replay that does not flush: channel block pid_c of the conv output
    # (x's H*P channels, then B's G*S) and, in block 0, the heads' time steps, copied from the
    # path's nodes into slots count .. count + steps - 1.
    steps = tl.minimum(tl.load(len_ptr + b).to(tl.int32), M)
    count = tl.load(count_ptr + b).to(tl.int32)
    if (count + steps + M <= L) & (FORCE == 0):
        offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        hp = H * P
        is_x = offs_c < hp
        is_B = (offs_c >= hp) & (offs_c < hp + (H // heads_per_group) * S)
        hh, pp = offs_c // P, offs_c % P
        gg, ss = (offs_c - hp) // S, (offs_c - hp) % S
        offs_h = tl.arange(0, BLOCK_HD)
        mask_h = offs_h < H
        # In chunks of UNROLL path steps, unrolled: a chunk's loads all in flight at once.
        for m0 in range(0, steps, UNROLL):
            for i in tl.static_range(UNROLL):
                live = m0 + i < steps
                node = tl.load(path_ptr + b * spb + (m0 + i) * spm, mask=live, other=0)
                slot = count + m0 + i
                live_c = (offs_c * 0 + m0 + i) < steps  # as vectors: masks of the lanes' own shape
                xv = tl.load(x_ptr + b * sxb + node * sxn + hh * sxh + pp * sxp, mask=is_x & live_c)
                tl.store(px_ptr + b * spxb + slot * spxl + hh * spxh + pp * spxp, xv.to(px_ptr.dtype.element_ty),
                         mask=is_x & live_c)
                Bv = tl.load(B_ptr + b * sBb + node * sBn + gg * sBg + ss * sBs, mask=is_B & live_c)
                tl.store(pB_ptr + b * spBb + slot * spBl + gg * spBg + ss * spBs, Bv.to(pB_ptr.dtype.element_ty),
                         mask=is_B & live_c)
                if pid_c == 0:
                    live_h = mask_h & ((offs_h * 0 + m0 + i) < steps)
                    dv = tl.load(dt_ptr + b * sdb + node * sdn + offs_h * sdh, mask=live_h)
                    tl.store(pdt_ptr + b * spdb + slot * spdl + offs_h * spdh, dv.to(pdt_ptr.dtype.element_ty),
                             mask=live_h)


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
    _replay_conv_tile(
        state_ptr, x_ptr, path_ptr, len_ptr, tl.program_id(0), tl.program_id(1),
        CH, M, ssb, ssc, ssk, sxb, sxn, sxc, spb, spm, HIST, BLOCK_H, BLOCK_C,
    )


def replay_conv_state(conv_state: torch.Tensor, xBC: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor) -> None:
    """Shift the accepted path's pre-conv inputs into the conv state, in place.

    Same contract as `naive_replay_conv_state`.

    Args:
        conv_state: (B, C, K-1) oldest first, updated in place.
        xBC: (B, N, C) pre-conv inputs of the verified tree.
        path: (B, M) int node indices, root first.
        path_len: (B,) int (read on the device).
    """
    _check_conv_replay("replay_conv_state", conv_state, xBC, path, path_len)
    batch, channels, history = conv_state.shape
    if history == 0 or conv_state.numel() == 0 or path.shape[1] == 0:
        return
    grid = (batch, triton.cdiv(channels, _CONV_BLOCK))
    _replay_conv_kernel[grid](
        conv_state, xBC, path, path_len,
        channels, path.shape[1],
        *conv_state.stride(), *xBC.stride(), *path.stride(),
        HIST=history, BLOCK_H=triton.next_power_of_2(history), BLOCK_C=_CONV_BLOCK, num_warps=4,
        **pdl_args(conv_state.device),
    )


@triton.jit
def _replay_states_program(
    pid, cs_ptr, xbc_ptr, h_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, path_ptr, len_ptr,
    n_ssm, n_bh, n_pblocks, n_cblocks,
    H, P, S, M, heads_per_group, CH,
    shb, shh, shp, shs,
    sxb, sxn, sxh, sxp,
    sdb, sdn, sdh,
    sBb, sBn, sBg, sBs,
    ssb, ssc, ssk,
    scb, scn, scc,
    spb, spm,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, UNROLL: tl.constexpr,
    HIST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    px_ptr=None, pdt_ptr=None, pB_ptr=None, count_ptr=None, L=0, FORCE=0,
    spxb=0, spxl=0, spxh=0, spxp=0, spdb=0, spdl=0, spdh=0, spBb=0, spBl=0, spBg=0, spBs=0,
    HAS_PENDING: tl.constexpr = False, BLOCK_L: tl.constexpr = 16, BLOCK_HD: tl.constexpr = 16,
    HAS_CONV: tl.constexpr = True, ssm_programs=0,
):
    # Program pid of one layer's replay. The branch is uniform per program, so the tiles'
    # barriers stay legal. Program order follows replay_ssm_state's 3-D grid (batch*head
    # fastest), then replay_conv_state's. With pending slots the first ssm_programs programs
    # loop over the SSM tiles (most replays only append, and idle tiles then cost a program
    # launch each: PENDING_SSM_PROGRAMS).
    if HAS_PENDING:
        n_tile_programs = ssm_programs
    else:
        n_tile_programs = n_ssm
    if pid < n_tile_programs:
        for tile in range(pid, n_ssm, n_tile_programs):
            pid_bh = tile % n_bh
            rest = tile // n_bh
            _replay_ssm_tile(
                h_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, path_ptr, len_ptr,
                pid_bh // H, pid_bh % H, rest % n_pblocks, rest // n_pblocks,
                P, S, M, heads_per_group,
                shb, shh, shp, shs, sxb, sxn, sxh, sxp, sdb, sdn, sdh, sBb, sBn, sBg, sBs, spb, spm,
                BLOCK_P, BLOCK_S, UNROLL,
                px_ptr, pdt_ptr, pB_ptr, count_ptr, L, FORCE,
                spxb, spxl, spxh, spxp, spdb, spdl, spdh, spBb, spBl, spBg, spBs, HAS_PENDING, BLOCK_L,
            )
    else:
        pid_c = pid - n_tile_programs
        if HAS_CONV:
            _replay_conv_tile(
                cs_ptr, xbc_ptr, path_ptr, len_ptr, pid_c // n_cblocks, pid_c % n_cblocks,
                CH, M, ssb, ssc, ssk, scb, scn, scc, spb, spm, HIST, BLOCK_H, BLOCK_C,
            )
        if HAS_PENDING:  # the conv tile read its inputs before this writes anything else
            _append_pending_tile(
                x_ptr, dt_ptr, B_ptr, path_ptr, len_ptr, pid_c // n_cblocks, pid_c % n_cblocks, M, H, P, S,
                heads_per_group, sxb, sxn, sxh, sxp, sdb, sdn, sdh, sBb, sBn, sBg, sBs, spb, spm,
                px_ptr, pdt_ptr, pB_ptr, count_ptr, L, FORCE,
                spxb, spxl, spxh, spxp, spdb, spdl, spdh, spBb, spBl, spBg, spBs, BLOCK_C, BLOCK_HD, UNROLL,
            )


@triton.jit
def _replay_states_kernel(
    cs_ptr, xbc_ptr, h_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, path_ptr, len_ptr,
    n_ssm, n_bh, n_pblocks, n_cblocks,
    H, P, S, M, heads_per_group, CH,
    shb, shh, shp, shs,
    sxb, sxn, sxh, sxp,
    sdb, sdn, sdh,
    sBb, sBn, sBg, sBs,
    ssb, ssc, ssk,
    scb, scn, scc,
    spb, spm,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, UNROLL: tl.constexpr,
    HIST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    px_ptr=None, pdt_ptr=None, pB_ptr=None, count_ptr=None, L=0, FORCE=0,
    spxb=0, spxl=0, spxh=0, spxp=0, spdb=0, spdl=0, spdh=0, spBb=0, spBl=0, spBg=0, spBs=0,
    HAS_PENDING: tl.constexpr = False, BLOCK_L: tl.constexpr = 16, BLOCK_HD: tl.constexpr = 16,
    HAS_CONV: tl.constexpr = True, ssm_programs=0,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    _replay_states_program(
        tl.program_id(0), cs_ptr, xbc_ptr, h_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, path_ptr, len_ptr,
        n_ssm, n_bh, n_pblocks, n_cblocks, H, P, S, M, heads_per_group, CH,
        shb, shh, shp, shs, sxb, sxn, sxh, sxp, sdb, sdn, sdh, sBb, sBn, sBg, sBs,
        ssb, ssc, ssk, scb, scn, scc, spb, spm,
        BLOCK_P, BLOCK_S, UNROLL, HIST, BLOCK_H, BLOCK_C,
        px_ptr, pdt_ptr, pB_ptr, count_ptr, L, FORCE,
        spxb, spxl, spxh, spxp, spdb, spdl, spdh, spBb, spBl, spBg, spBs, HAS_PENDING, BLOCK_L, BLOCK_HD, HAS_CONV,
        ssm_programs,
    )


PENDING_SSM_PROGRAMS = 16
"""With pending slots, programs per layer (and batch) that loop over the SSM state tiles; 0: one
program per tile. Most such replays only append, so idle tile programs would be launched for
nothing."""


def _tile_programs(n_ssm: int, pending) -> int:
    if pending is None or not PENDING_SSM_PROGRAMS:
        return n_ssm
    return min(n_ssm, PENDING_SSM_PROGRAMS)


def _states_grid(conv_state: torch.Tensor, ssm_state: torch.Tensor, steps: int, pending: bool = False):
    """The 1-D grid of `_replay_states_kernel` (SSM tiles first, then conv-state channel blocks,
    which also append to pending slots): (SSM tile sizes, batch*heads, P blocks, SSM programs,
    conv blocks per row, conv programs)."""
    batch, channels, history = conv_state.shape
    _, heads, head_dim, d_state = ssm_state.shape
    blocks = _ssm_blocks(head_dim, d_state, steps, pending)
    n_bh = batch * heads
    n_pblocks = triton.cdiv(head_dim, blocks["BLOCK_P"])
    n_ssm = n_bh * n_pblocks * triton.cdiv(d_state, blocks["BLOCK_S"]) if ssm_state.numel() else 0
    n_cblocks = triton.cdiv(channels, _CONV_BLOCK)
    n_conv = batch * n_cblocks if (history and conv_state.numel()) or pending else 0
    return blocks, n_bh, n_pblocks, n_ssm, n_cblocks, n_conv


def replay_states(
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    xBC: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    path: torch.Tensor,
    path_len: torch.Tensor,
    pending=None,
) -> None:
    """`replay_conv_state` and `replay_ssm_state` of one Mamba layer in a single launch.

    Same contract as `naive_replay_states`; both states are updated in place (with `pending`,
    the SSM state only when the row flushes; the positions are not advanced here).

    Args:
        conv_state: (B, C, K-1) oldest first.
        ssm_state: (B, H, P, S) fp32.
        xBC: (B, N, C) pre-conv inputs; x: (B, N, H, P); dt: (B, N, H); B: (B, N, G, S)
            cached activations of the verified tree.
        A: (H,).
        path: (B, M) int node indices, root first.
        path_len: (B,) int (read on the device).
    """
    _check_conv_replay("replay_states", conv_state, xBC, path, path_len)
    _check_ssm_replay("replay_states", ssm_state, x, B, path, path_len)
    _check_pending("replay_states", pending, ssm_state, x, dt, B)
    channels, history = conv_state.shape[1:]
    _, heads, head_dim, d_state = ssm_state.shape
    steps = path.shape[1]
    if steps == 0:
        return
    blocks, n_bh, n_pblocks, n_ssm, n_cblocks, n_conv = _states_grid(conv_state, ssm_state, steps, pending is not None)
    if n_ssm + n_conv == 0:
        return
    tile_programs = _tile_programs(n_ssm, pending)
    _replay_states_kernel[(tile_programs + n_conv,)](
        conv_state, xBC, ssm_state, x, dt, A, B, path, path_len,
        n_ssm, n_bh, n_pblocks, n_cblocks,
        heads, head_dim, d_state, steps, heads // B.shape[2], channels,
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(),
        *conv_state.stride(), *xBC.stride(), *path.stride(),
        **blocks, HIST=max(history, 1), BLOCK_H=triton.next_power_of_2(max(history, 1)), BLOCK_C=_CONV_BLOCK,
        num_warps=4, **pdl_args(ssm_state.device),
        **({} if pending is None else dict(px_ptr=pending[0], pdt_ptr=pending[1], pB_ptr=pending[2])),
        **_pending_args(pending), HAS_CONV=history > 0, ssm_programs=tile_programs,
    )


def _check_pending(op, pending, ssm_state, x, dt, B):
    """Pending inputs must match the layer's state and its activations' dtypes (the kernels read
    them with the activations' element types)."""
    if pending is None:
        return
    px, pdt, pB, count = pending
    batch, heads, head_dim, d_state = ssm_state.shape
    capacity = px.shape[1]
    want = {"x": (px, (batch, capacity, heads, head_dim), x.dtype), "dt": (pdt, (batch, capacity, heads), torch.float32),
            "B": (pB, (batch, capacity, B.shape[2], d_state), B.dtype)}
    for name, (t, shape, dtype) in want.items():
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{op}: pending {name} is {tuple(t.shape)} {t.dtype}, expected {shape} {dtype}")
    if tuple(count.shape) != (batch,):
        raise ValueError(f"{op}: the pending count {tuple(count.shape)} needs {batch} rows")


def _pending_args(pending, force: bool = False) -> dict:
    """The SSM tiles' pending arguments but the three pending base pointers (layer 0's strides)."""
    if pending is None:
        return {}
    px, pdt, pB, count = pending
    return dict(count_ptr=count, L=px.shape[1], FORCE=int(force),
                BLOCK_L=max(16, triton.next_power_of_2(px.shape[1])), BLOCK_HD=triton.next_power_of_2(px.shape[2]),
                spxb=px.stride(0), spxl=px.stride(1), spxh=px.stride(2), spxp=px.stride(3),
                spdb=pdt.stride(0), spdl=pdt.stride(1), spdh=pdt.stride(2),
                spBb=pB.stride(0), spBl=pB.stride(1), spBg=pB.stride(2), spBs=pB.stride(3), HAS_PENDING=True)


@triton.jit
def _table_ptr(table_ptr, layer, column: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
               COLUMNS: tl.constexpr = 7):
    # Entry (layer, column) of the (L, COLUMNS) pointer table as a pointer to DTYPE.
    ptr = tl.load(table_ptr + layer * COLUMNS + column).to(tl.pointer_type(DTYPE))
    if ALIGNED:  # what Triton's argument specialisation tells replay_states of 16-byte-aligned tensors
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def _replay_states_layers_kernel(
    table_ptr, path_ptr, len_ptr,
    n_ssm, n_bh, n_pblocks, n_cblocks,
    H, P, S, M, heads_per_group, CH,
    shb, shh, shp, shs,
    sxb, sxn, sxh, sxp,
    sdb, sdn, sdh,
    sBb, sBn, sBg, sBs,
    ssb, ssc, ssk,
    scb, scn, scc,
    spb, spm,
    CS_DTYPE: tl.constexpr, XBC_DTYPE: tl.constexpr, X_DTYPE: tl.constexpr, DT_DTYPE: tl.constexpr,
    A_DTYPE: tl.constexpr, B_DTYPE: tl.constexpr, ALIGNED: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, UNROLL: tl.constexpr,
    HIST: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    count_ptr=None, L=0, FORCE=0,
    spxb=0, spxl=0, spxh=0, spxp=0, spdb=0, spdl=0, spdh=0, spBb=0, spBl=0, spBg=0, spBs=0,
    HAS_PENDING: tl.constexpr = False, COLUMNS: tl.constexpr = 7, BLOCK_L: tl.constexpr = 16,
    BLOCK_HD: tl.constexpr = 16, HAS_CONV: tl.constexpr = True, ssm_programs=0,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    layer = tl.program_id(1)
    # Table columns in replay_states_layers' argument order: conv, ssm, xBC, x, dt, A, B, then
    # with pending inputs (COLUMNS 10) the pending x, dt, B.
    if HAS_PENDING:
        px_ptr = _table_ptr(table_ptr, layer, 7, X_DTYPE, ALIGNED, COLUMNS)
        pdt_ptr = _table_ptr(table_ptr, layer, 8, tl.float32, ALIGNED, COLUMNS)
        pB_ptr = _table_ptr(table_ptr, layer, 9, B_DTYPE, ALIGNED, COLUMNS)
    else:  # never read
        px_ptr = table_ptr
        pdt_ptr = table_ptr
        pB_ptr = table_ptr
    _replay_states_program(
        tl.program_id(0),
        _table_ptr(table_ptr, layer, 0, CS_DTYPE, ALIGNED, COLUMNS),
        _table_ptr(table_ptr, layer, 2, XBC_DTYPE, ALIGNED, COLUMNS),
        _table_ptr(table_ptr, layer, 1, tl.float32, ALIGNED, COLUMNS),
        _table_ptr(table_ptr, layer, 3, X_DTYPE, ALIGNED, COLUMNS),
        _table_ptr(table_ptr, layer, 4, DT_DTYPE, ALIGNED, COLUMNS),
        _table_ptr(table_ptr, layer, 5, A_DTYPE, ALIGNED, COLUMNS),
        _table_ptr(table_ptr, layer, 6, B_DTYPE, ALIGNED, COLUMNS), path_ptr, len_ptr,
        n_ssm, n_bh, n_pblocks, n_cblocks, H, P, S, M, heads_per_group, CH,
        shb, shh, shp, shs, sxb, sxn, sxh, sxp, sdb, sdn, sdh, sBb, sBn, sBg, sBs,
        ssb, ssc, ssk, scb, scn, scc, spb, spm,
        BLOCK_P, BLOCK_S, UNROLL, HIST, BLOCK_H, BLOCK_C,
        px_ptr, pdt_ptr, pB_ptr, count_ptr, L, FORCE,
        spxb, spxl, spxh, spxp, spdb, spdl, spdh, spBb, spBl, spBg, spBs, HAS_PENDING, BLOCK_L, BLOCK_HD, HAS_CONV,
        ssm_programs,
    )


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

def _layout(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device


def replay_states_layers(
    conv_states: list[torch.Tensor],
    ssm_states: list[torch.Tensor],
    xBCs: list[torch.Tensor],
    xs: list[torch.Tensor],
    dts: list[torch.Tensor],
    As: list[torch.Tensor],
    Bs: list[torch.Tensor],
    path: torch.Tensor,
    path_len: torch.Tensor,
    pending=None,
) -> None:
    """`replay_states` of every Mamba layer of a model in a single launch.

    Same contract as `naive_replay_states_layers`. The launch reads each layer's tensors through a
    device table of base addresses and uses layer 0's strides for all, so every layer's tensors
    must have the same shapes, strides and dtypes as layer 0's; where they do not, this falls back
    to one `replay_states` launch per layer.

    Args:
        conv_states: L tensors (B, C, K-1) oldest first, updated in place.
        ssm_states: L tensors (B, H, P, S) fp32, updated in place.
        xBCs: L tensors (B, N, C) pre-conv inputs; xs: L (B, N, H, P); dts: L (B, N, H);
            Bs: L (B, N, G, S) cached activations of the verified tree.
        As: L tensors (H,).
        path: (B, M) int node indices, root first, shared by all layers.
        path_len: (B,) int (read on the device).
        pending: None, or (xs, dts, Bs, count), the pending inputs of each layer (the
            tables take three more columns); positions are not advanced here.
    """
    layers = layer_arguments(conv_states, ssm_states, xBCs, xs, dts, As, Bs)
    per_layer = pending_per_layer(pending, len(layers))
    for (conv_state, ssm_state, xBC, x, dt, _, B), layer_pending in zip(layers, per_layer):
        _check_conv_replay("replay_states_layers", conv_state, xBC, path, path_len)
        _check_ssm_replay("replay_states_layers", ssm_state, x, B, path, path_len)
        _check_pending("replay_states_layers", layer_pending, ssm_state, x, dt, B)
    if not layers:
        return
    if pending is not None:  # the pending x, dt, B join each layer's row of the table
        layers = [(*layer, *p[:3]) for layer, p in zip(layers, per_layer)]
    first = [_layout(t) for t in layers[0]]
    shared = all(t.dtype in _TL_DTYPES for t in layers[0]) and all([_layout(t) for t in layer] == first
                                                                     for layer in layers[1:])
    if len(layers) == 1 or not shared:
        for layer, layer_pending in zip(layers, per_layer):
            replay_states(*layer[:7], path, path_len, layer_pending)
        return
    conv_state, ssm_state, xBC, x, dt, A, B = layers[0][:7]
    channels, history = conv_state.shape[1:]
    _, heads, head_dim, d_state = ssm_state.shape
    steps = path.shape[1]
    if steps == 0:
        return
    blocks, n_bh, n_pblocks, n_ssm, n_cblocks, n_conv = _states_grid(conv_state, ssm_state, steps, pending is not None)
    if n_ssm + n_conv == 0:
        return
    rows = [[t.data_ptr() for t in layer] for layer in layers]
    table = device_table(rows, ssm_state.device)
    tile_programs = _tile_programs(n_ssm, pending)
    _replay_states_layers_kernel[(tile_programs + n_conv, len(layers))](
        table, path, path_len,
        n_ssm, n_bh, n_pblocks, n_cblocks,
        heads, head_dim, d_state, steps, heads // B.shape[2], channels,
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(),
        *conv_state.stride(), *xBC.stride(), *path.stride(),
        CS_DTYPE=_TL_DTYPES[conv_state.dtype], XBC_DTYPE=_TL_DTYPES[xBC.dtype], X_DTYPE=_TL_DTYPES[x.dtype],
        DT_DTYPE=_TL_DTYPES[dt.dtype], A_DTYPE=_TL_DTYPES[A.dtype], B_DTYPE=_TL_DTYPES[B.dtype],
        ALIGNED=all(p % 16 == 0 for row in rows for p in row),
        **blocks, HIST=max(history, 1), BLOCK_H=triton.next_power_of_2(max(history, 1)), BLOCK_C=_CONV_BLOCK,
        num_warps=4, **pdl_args(ssm_state.device),
        **_pending_args(per_layer[0]), COLUMNS=len(rows[0]), HAS_CONV=history > 0, ssm_programs=tile_programs,
    )


def settle_pending_layers(ssm_states: list[torch.Tensor], As: list[torch.Tensor], pending) -> None:
    """Flush every layer's pending inputs into its SSM state, in one launch: the layers kernel's
    SSM tiles with an empty path and FORCE. Same contract as `naive_settle_pending_layers` (the
    caller then sets the count to 0)."""
    per_layer = pending_per_layer(pending, len(ssm_states))
    if not ssm_states:
        return
    count = pending[3]
    device = count.device
    path = torch.zeros(count.shape[0], 1, dtype=torch.long, device=device)
    no_steps = torch.zeros(count.shape[0], dtype=torch.long, device=device)
    for ssm_state, layer_pending in zip(ssm_states, per_layer):
        _check_pending("settle_pending_layers", layer_pending, ssm_state, *layer_pending[:3])
    # The pending tensors stand in for the tree's activations (never read: the path is empty)
    # and for the conv state (no conv tiles run).
    layers = [(s, s, px, px, pdt, A, pB, px, pdt, pB) for s, A, (px, pdt, pB, _) in zip(ssm_states, As, per_layer)]
    first = [_layout(t) for t in layers[0]]
    if not all([_layout(t) for t in layer] == first for layer in layers[1:]):
        for layer, layer_pending in zip(layers, per_layer):  # one launch per layer
            settle_pending_layers([layer[1]], [layer[5]], (*([t] for t in layer_pending[:3]), count))
        return
    ssm_state, px, pdt, A, pB = layers[0][1], layers[0][2], layers[0][4], layers[0][5], layers[0][6]
    _, heads, head_dim, d_state = ssm_state.shape
    blocks, n_bh, n_pblocks, n_ssm, n_cblocks, _ = _states_grid(ssm_state.new_empty(ssm_state.shape[0], 0, 0), ssm_state, 1, True)
    if n_ssm == 0:
        return
    rows = [[t.data_ptr() for t in layer] for layer in layers]
    _replay_states_layers_kernel[(n_ssm, len(layers))](  # a settle flushes: every tile its own program
        device_table(rows, device), path, no_steps,
        n_ssm, n_bh, n_pblocks, n_cblocks,
        heads, head_dim, d_state, 1, heads // pB.shape[2], 1,
        *ssm_state.stride(), *px.stride(), *pdt.stride(), *pB.stride(),
        0, 0, 0, 0, 0, 0, *path.stride(),
        CS_DTYPE=tl.float32, XBC_DTYPE=_TL_DTYPES[px.dtype], X_DTYPE=_TL_DTYPES[px.dtype],
        DT_DTYPE=tl.float32, A_DTYPE=_TL_DTYPES[A.dtype], B_DTYPE=_TL_DTYPES[pB.dtype],
        ALIGNED=all(p % 16 == 0 for row in rows for p in row),
        **blocks, HIST=1, BLOCK_H=1, BLOCK_C=_CONV_BLOCK,
        num_warps=4, **pdl_args(device),
        **_pending_args(per_layer[0], force=True), COLUMNS=10, ssm_programs=n_ssm,
    )


@triton.jit
def _advance_positions_kernel(seqlen_ptr, count_ptr, len_ptr, batch, M, L, BLOCK: tl.constexpr,
                              USE_PDL: tl.constexpr = False):
    # naive_advance_positions: one program for all rows; the replay before it read the counts.
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    offs = tl.arange(0, BLOCK)
    mask = offs < batch
    seqlen = tl.load(seqlen_ptr + offs, mask=mask, other=0)
    count = tl.load(count_ptr + offs, mask=mask, other=0)
    steps = tl.minimum(tl.load(len_ptr + offs, mask=mask, other=0).to(tl.int64), M)
    flush = count + steps + M > L
    tl.store(count_ptr + offs, tl.where(flush, 0, count + steps).to(count.dtype), mask=mask)
    tl.store(seqlen_ptr + offs, (seqlen + steps).to(seqlen.dtype), mask=mask)


def advance_positions(seqlen: torch.Tensor, count: torch.Tensor, path_len: torch.Tensor, width: int,
                      capacity: int) -> None:
    """`naive_advance_positions` in one launch (in place; reads path_len on the device)."""
    batch = seqlen.shape[0]
    if batch == 0:
        return
    _advance_positions_kernel[(1,)](seqlen, count, path_len, batch, width, capacity,
                                    BLOCK=max(16, triton.next_power_of_2(batch)), num_warps=1,
                                    **pdl_args(seqlen.device))
