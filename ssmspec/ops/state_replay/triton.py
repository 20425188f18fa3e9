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

from ..pdl import gdc_launch_dependents, gdc_wait
from ..step_update.triton import _pdl_args
from .naive import layer_arguments


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
):
    # One (BLOCK_P, BLOCK_S) tile of the state of (batch row b, head h), advanced over the path.
    g = h // heads_per_group
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    mask_p = offs_p < P
    mask_s = offs_s < S
    mask = mask_p[:, None] & mask_s[None, :]
    h_ptrs = h_ptr + b * shb + h * shh + offs_p[:, None] * shp + offs_s[None, :] * shs
    state = tl.load(h_ptrs, mask=mask, other=0.0)
    A = tl.load(A_ptr + h).to(tl.float32)
    steps = tl.minimum(tl.load(len_ptr + b).to(tl.int32), M)
    # The path in chunks of UNROLL steps, unrolled, with the steps past `steps` masked to dt = 0
    # (no change): a chunk's loads are independent of the state and can all be in flight at once
    # instead of one dependent chain per step. Masked steps read node 0, which always exists.
    for m0 in range(0, steps, UNROLL):
        for i in tl.static_range(UNROLL):
            live = m0 + i < steps
            node = tl.load(path_ptr + b * spb + (m0 + i) * spm, mask=live, other=0)
            dt = tl.load(dt_ptr + b * sdb + node * sdn + h * sdh, mask=live, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + b * sxb + node * sxn + h * sxh + offs_p * sxp, mask=mask_p, other=0.0).to(tl.float32)
            Bv = tl.load(B_ptr + b * sBb + node * sBn + g * sBg + offs_s * sBs, mask=mask_s, other=0.0).to(tl.float32)
            state = state * tl.exp(dt * A) + (dt * xv)[:, None] * Bv[None, :]
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


def _ssm_blocks(head_dim: int, d_state: int, steps: int) -> dict:
    """Tile sizes of the SSM replay; the path runs in unrolled chunks of up to 16 steps (see _replay_ssm_tile)."""
    return {"BLOCK_P": min(32, triton.next_power_of_2(head_dim)), "BLOCK_S": min(64, triton.next_power_of_2(d_state)),
            "UNROLL": min(steps, 16)}


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
        **blocks, num_warps=4, **_pdl_args(ssm_state.device),
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
        **_pdl_args(conv_state.device),
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
):
    # Program pid of one layer's replay. The branch is uniform per program, so the tiles'
    # barriers stay legal. Program order follows replay_ssm_state's 3-D grid (batch*head
    # fastest), then replay_conv_state's.
    if pid < n_ssm:
        pid_bh = pid % n_bh
        rest = pid // n_bh
        _replay_ssm_tile(
            h_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, path_ptr, len_ptr,
            pid_bh // H, pid_bh % H, rest % n_pblocks, rest // n_pblocks,
            P, S, M, heads_per_group,
            shb, shh, shp, shs, sxb, sxn, sxh, sxp, sdb, sdn, sdh, sBb, sBn, sBg, sBs, spb, spm,
            BLOCK_P, BLOCK_S, UNROLL,
        )
    else:
        pid_c = pid - n_ssm
        _replay_conv_tile(
            cs_ptr, xbc_ptr, path_ptr, len_ptr, pid_c // n_cblocks, pid_c % n_cblocks,
            CH, M, ssb, ssc, ssk, scb, scn, scc, spb, spm, HIST, BLOCK_H, BLOCK_C,
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
    )


def _states_grid(conv_state: torch.Tensor, ssm_state: torch.Tensor, steps: int):
    """The 1-D grid of `_replay_states_kernel` (SSM tiles first, then conv-state channel blocks):
    (SSM tile sizes, batch*heads, P blocks, SSM programs, conv blocks per row, conv programs)."""
    batch, channels, history = conv_state.shape
    _, heads, head_dim, d_state = ssm_state.shape
    blocks = _ssm_blocks(head_dim, d_state, steps)
    n_bh = batch * heads
    n_pblocks = triton.cdiv(head_dim, blocks["BLOCK_P"])
    n_ssm = n_bh * n_pblocks * triton.cdiv(d_state, blocks["BLOCK_S"]) if ssm_state.numel() else 0
    n_cblocks = triton.cdiv(channels, _CONV_BLOCK)
    n_conv = batch * n_cblocks if history and conv_state.numel() else 0
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
) -> None:
    """`replay_conv_state` and `replay_ssm_state` of one Mamba layer in a single launch.

    Same contract as `naive_replay_states`; both states are updated in place.

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
    channels, history = conv_state.shape[1:]
    _, heads, head_dim, d_state = ssm_state.shape
    steps = path.shape[1]
    if steps == 0:
        return
    blocks, n_bh, n_pblocks, n_ssm, n_cblocks, n_conv = _states_grid(conv_state, ssm_state, steps)
    if n_ssm + n_conv == 0:
        return
    _replay_states_kernel[(n_ssm + n_conv,)](
        conv_state, xBC, ssm_state, x, dt, A, B, path, path_len,
        n_ssm, n_bh, n_pblocks, n_cblocks,
        heads, head_dim, d_state, steps, heads // B.shape[2], channels,
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(),
        *conv_state.stride(), *xBC.stride(), *path.stride(),
        **blocks, HIST=max(history, 1), BLOCK_H=triton.next_power_of_2(max(history, 1)), BLOCK_C=_CONV_BLOCK,
        num_warps=4, **_pdl_args(ssm_state.device),
    )


@triton.jit
def _table_ptr(table_ptr, layer, column: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    # Entry (layer, column) of the (L, 7) pointer table as a pointer to DTYPE.
    ptr = tl.load(table_ptr + layer * 7 + column).to(tl.pointer_type(DTYPE))
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
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    layer = tl.program_id(1)
    # Table columns in replay_states_layers' argument order: conv, ssm, xBC, x, dt, A, B.
    _replay_states_program(
        tl.program_id(0),
        _table_ptr(table_ptr, layer, 0, CS_DTYPE, ALIGNED), _table_ptr(table_ptr, layer, 2, XBC_DTYPE, ALIGNED),
        _table_ptr(table_ptr, layer, 1, tl.float32, ALIGNED), _table_ptr(table_ptr, layer, 3, X_DTYPE, ALIGNED),
        _table_ptr(table_ptr, layer, 4, DT_DTYPE, ALIGNED), _table_ptr(table_ptr, layer, 5, A_DTYPE, ALIGNED),
        _table_ptr(table_ptr, layer, 6, B_DTYPE, ALIGNED), path_ptr, len_ptr,
        n_ssm, n_bh, n_pblocks, n_cblocks, H, P, S, M, heads_per_group, CH,
        shb, shh, shp, shs, sxb, sxn, sxh, sxp, sdb, sdn, sdh, sBb, sBn, sBg, sBs,
        ssb, ssc, ssk, scb, scn, scc, spb, spm,
        BLOCK_P, BLOCK_S, UNROLL, HIST, BLOCK_H, BLOCK_C,
    )


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

_CAPTURED_TABLES: list[torch.Tensor] = []
"""Pinned host pointer tables of captured launches: a captured copy reads its host buffer at every
replay of the graph, so these live as long as the process (a few KB per capture)."""


def _pointer_table(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """(L, 7) int64 addresses on `device`, built without a host sync and safe to capture in a CUDA graph."""
    if device.type != "cuda":  # the interpreter reads host memory
        return torch.tensor(rows, dtype=torch.int64)
    host = torch.tensor(rows, dtype=torch.int64, pin_memory=True)
    if torch.cuda.is_current_stream_capturing():
        _CAPTURED_TABLES.append(host)
    # Outside capture the caching host allocator keeps `host` until the copy has run.
    return host.to(device, non_blocking=True)


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
    """
    layers = layer_arguments(conv_states, ssm_states, xBCs, xs, dts, As, Bs)
    for conv_state, ssm_state, xBC, x, _, _, B in layers:
        _check_conv_replay("replay_states_layers", conv_state, xBC, path, path_len)
        _check_ssm_replay("replay_states_layers", ssm_state, x, B, path, path_len)
    if not layers:
        return
    first = [_layout(t) for t in layers[0]]
    shared = all(t.dtype in _TL_DTYPES for t in layers[0]) and all([_layout(t) for t in layer] == first
                                                                     for layer in layers[1:])
    if len(layers) == 1 or not shared:
        for layer in layers:
            replay_states(*layer, path, path_len)
        return
    conv_state, ssm_state, xBC, x, dt, A, B = layers[0]
    channels, history = conv_state.shape[1:]
    _, heads, head_dim, d_state = ssm_state.shape
    steps = path.shape[1]
    if steps == 0:
        return
    blocks, n_bh, n_pblocks, n_ssm, n_cblocks, n_conv = _states_grid(conv_state, ssm_state, steps)
    if n_ssm + n_conv == 0:
        return
    rows = [[t.data_ptr() for t in layer] for layer in layers]
    table = _pointer_table(rows, ssm_state.device)
    _replay_states_layers_kernel[(n_ssm + n_conv, len(layers))](
        table, path, path_len,
        n_ssm, n_bh, n_pblocks, n_cblocks,
        heads, head_dim, d_state, steps, heads // B.shape[2], channels,
        *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(),
        *conv_state.stride(), *xBC.stride(), *path.stride(),
        CS_DTYPE=_TL_DTYPES[conv_state.dtype], XBC_DTYPE=_TL_DTYPES[xBC.dtype], X_DTYPE=_TL_DTYPES[x.dtype],
        DT_DTYPE=_TL_DTYPES[dt.dtype], A_DTYPE=_TL_DTYPES[A.dtype], B_DTYPE=_TL_DTYPES[B.dtype],
        ALIGNED=all(p % 16 == 0 for row in rows for p in row),
        **blocks, HIST=max(history, 1), BLOCK_H=triton.next_power_of_2(max(history, 1)), BLOCK_C=_CONV_BLOCK,
        num_warps=4, **_pdl_args(ssm_state.device),
    )
