"""A folded Mamba-2 sublayer at batch 1 in two launches: in_proj with the step inside it, then
out_proj; `naive.py` is the spec.

The unfused route is three launches per layer: the in_proj GEMV, the step kernel (conv update,
state update, gate) and the out_proj GEMV. The step kernel needs in_proj's B and C rows, which
every head shares, so it could only start once all of in_proj had finished; on the H100 it
left the weight stream idle for ~5.5 us per layer (BENCHMARKS.md, round 3's timeline).

Here in_proj's rows are dealt out by head. A head program owns BLOCK_P channels of one head:
their z and x rows, whose weights it loads whole before the PDL wait, as the GEMV preloads a
row, so the x channels' conv and the state update of its (BLOCK_P, S) slice need nothing from
other programs but B, C and the head's dt. Those rows (2*G*S + H, the last rows of in_proj) go to
N_SHARED programs of their own, which convolve B and C, publish them and dt to a small buffer
and count themselves done on a flag. A head program waits on that flag only after its own dot
products, and the shared programs take the first tickets (below), so the step's latency moves
under the weight stream, apart from the last programs' tails.

Roles come from a ticket (an atomic counter) rather than the program id: the programs that
take the first tickets of a launch are running, so the B/C work a head program waits for
always belongs to a program that has started, whatever order the hardware dispatches them in.
Both counters only grow (int64): launch e of a layer hands out tickets e*n .. e*n + n - 1 and
its head programs wait for the flag to reach (e + 1) * N_SHARED. Nothing has to reset them, so an
interrupted sequence of launches cannot leave a layer's counters in a state that hangs the next.
The ticket is the only global access before the PDL wait (ops/pdl.py): no other kernel
touches these counters.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .. import pdl
from ..pdl import gdc_launch_dependents, gdc_wait
from ..step_update.triton import _conv_history, _launch_out_proj, _shift_in, _softplus

FUSED = True
"""Benchmarks set this False to time the unfused route (in_proj GEMV, step, out_proj)."""
BLOCK_P = 4
"""x channels (and z rows) per head program: 2 * BLOCK_P weight rows, whole rows loaded at once."""
NUM_WARPS = 4
PROGRAMS_PER_SM = 4
GRID: int | None = None
"""Set to fix the number of programs (tests run several items per program with it)."""
TICKET = True
"""Roles by ticket (see the module docstring). False: by program id, the flag reset by out_proj's
kernel, and the B/C/dt programs relying on the hardware dispatching low program ids first."""
TAIL = True
"""False only for bench/layer_step_probe.py: time the dot products without the step (wrong results)."""
WAIT = True
"""False only for bench/layer_step_probe.py, to time what waiting on the B/C/dt programs costs."""


def _row_pieces(d_model: int) -> tuple[int, int]:
    """A row of d_model columns as two power-of-two pieces (2560 = 2048 + 512, 4096 = 2048 +
    2048), so that a preloaded row wastes few registers on padding (as ops/gemv's preload)."""
    first = triton.next_power_of_2(d_model) // 2
    return first, triton.next_power_of_2(d_model - first)


def _grid(n_items: int, device: torch.device) -> int:
    """Programs of the persistent launch: PROGRAMS_PER_SM per SM (GRID overrides), at most one per item."""
    if GRID is not None:
        return max(1, min(n_items, GRID))
    if device.type != "cuda":
        return n_items
    return min(n_items, PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count)

def _flag(in_weight: torch.Tensor) -> torch.Tensor:
    """The flag of the layer's ticket-free launches (TICKET False), reset by out_proj's kernel."""
    return _counters(in_weight, 0)[1:]


def _counters(in_weight: torch.Tensor, n_prog: int) -> torch.Tensor:
    """The (ticket, flag) int64 counters of the layer whose in_proj weight this is, for a grid
    of n_prog programs. They are kept on the weight tensor, one pair per grid size, for as long
    as the weight lives: a CUDA graph captured with one pair keeps using it after a call with
    another grid size, and a pair must never be freed and reused under a captured graph. Created
    zero (the first call runs outside graph capture, as the warm-up does): tickets must start at
    a multiple of the grid size for the launch epochs to line up."""
    kept = getattr(in_weight, "_layer_step_counters", None)
    if kept is None:
        kept = in_weight._layer_step_counters = {}
    if n_prog not in kept:
        kept[n_prog] = torch.zeros(2, device=in_weight.device, dtype=torch.int64)
    return kept[n_prog]


@triton.jit
def _item_rows(item, n_items, d_inner, GS, H, P, N_SHARED: tl.constexpr, BLOCK_P: tl.constexpr):
    """Which rows work item `item` covers, as R = 2 * BLOCK_P lanes. A head item interleaves the
    z rows (even lanes) and x rows (odd lanes) of channels p0 + i // 2 of one head; a shared item
    takes R consecutive rows of B, C and dt, the last rows of in_proj (shared index j: B and C
    at [0, 2GS), dt at [2GS, 2GS + H)). Items at or past n_items have every lane masked."""
    R: tl.constexpr = 2 * BLOCK_P
    i = tl.arange(0, R)
    pblocks = tl.cdiv(P, BLOCK_P)
    u = tl.maximum(item - N_SHARED, 0)
    head = u // pblocks
    p0 = (u % pblocks) * BLOCK_P
    is_x = (i % 2) == 1
    head_ch = head * P + p0 + i // 2
    head_ok = (p0 + i // 2 < P) & ((i * 0 + item) < n_items)
    j = item * R + i
    shared_lanes = (i * 0 + item) < N_SHARED  # item < N_SHARED as a block (the interpreter masks with blocks)
    rows = tl.where(shared_lanes, 2 * d_inner + j, tl.where(is_x, d_inner + head_ch, head_ch))
    rmask = tl.where(shared_lanes, j < 2 * GS + H, head_ok)
    cc = tl.where(shared_lanes, d_inner + j, head_ch)  # conv channels (xBC index) of the lanes
    cmask = tl.where(shared_lanes, j < 2 * GS, head_ok & is_x)
    return head, p0, j, rows, rmask, cc, cmask


@triton.jit
def _item_loads(w_ptr, ss_ptr, cs_ptr, cw_ptr, cb_ptr, item, n_items, rows, rmask, cc, cmask, head, p0, DM, P, S, swn,
                shh, shp, shs, scc, sck, swc, swk, in_dtype, N_SHARED: tl.constexpr, K: tl.constexpr,
                HAS_CONV_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_KC: tl.constexpr,
                BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr):
    """What an item needs that no kernel of this step writes: its rows' whole weights (two
    power-of-two pieces, as ops/gemv preloads a row), a head item's (BLOCK_P, S) state slice, the
    conv history and taps. States were last written by this layer's previous step or by replay;
    every step starts with the embedding lookup, a plain launch that waits for all earlier work."""
    w_rows = w_ptr + rows[:, None] * swn
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    wt1 = tl.load(w_rows + offs_d1[None, :], mask=rmask[:, None] & (offs_d1 < DM)[None, :], other=0.0,
                  eviction_policy="evict_first")
    wt2 = tl.load(w_rows + offs_d2[None, :], mask=rmask[:, None] & (offs_d2 < DM)[None, :], other=0.0,
                  eviction_policy="evict_first")
    offs_pp = p0 + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    head_pp = (offs_pp < P) & ((offs_pp * 0 + item) >= N_SHARED) & ((offs_pp * 0 + item) < n_items)
    state = tl.load(ss_ptr + head * shh + offs_pp[:, None] * shp + offs_s[None, :] * shs,
                    mask=head_pp[:, None] & (offs_s < S)[None, :], other=0.0)
    hist, w_last = _conv_history(cs_ptr, cw_ptr, cc, cmask, in_dtype, scc, sck, swc, swk, K, BLOCK_KC)
    if HAS_CONV_BIAS:
        hist += tl.load(cb_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
    return wt1, wt2, state, hist, w_last


@triton.jit
def _in_proj_step_kernel(
    h_ptr, w_ptr, b_ptr, cs_ptr, ss_ptr, cw_ptr, cb_ptr, dtb_ptr, Alog_ptr, D_ptr,
    g_ptr, shared_ptr, sync_ptr,
    DM, pre_eps, H, P, S, G, heads_per_group, dt_min, dt_max,
    swn, scc, sck, shh, shp, shs, swc, swk,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_KC: tl.constexpr, BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr, N_SHARED: tl.constexpr, USE_PDL: tl.constexpr, WAIT: tl.constexpr = True,
    TICKET: tl.constexpr = True, TAIL: tl.constexpr = True,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now
        gdc_launch_dependents()
    n_prog = tl.num_programs(0)
    if TICKET:
        ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")  # see the module docstring
        epoch = ticket // n_prog
        vpid = (ticket % n_prog).to(tl.int32)
    else:  # by program id; out_proj's kernel resets the flag (see TICKET)
        epoch = 0
        vpid = tl.program_id(0)
    d_inner = H * P
    GS = G * S
    n_items = N_SHARED + H * tl.cdiv(P, BLOCK_P)
    in_dtype = h_ptr.dtype.element_ty
    offs_s = tl.arange(0, BLOCK_S)

    # The program's first item is loaded before the PDL wait; inside the loop each item's loads
    # go out before the previous item's dot products and step, so a program keeps weights in
    # flight through its items' tails (items vpid, vpid + n_prog, ...).
    head, p0, j, rows, rmask, cc, cmask = _item_rows(vpid, n_items, d_inner, GS, H, P, N_SHARED, BLOCK_P)
    wt1, wt2, state, hist, w_last = _item_loads(
        w_ptr, ss_ptr, cs_ptr, cw_ptr, cb_ptr, vpid, n_items, rows, rmask, cc, cmask, head, p0, DM, P, S, swn,
        shh, shp, shs, scc, sck, swc, swk, in_dtype, N_SHARED, K, HAS_CONV_BIAS, BLOCK_P, BLOCK_S, BLOCK_KC,
        BLOCK_D1, BLOCK_D2)
    if USE_PDL:
        gdc_wait()
    # h's RMSNorm scales the dot products at the end (its weight is folded into in_proj's).
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
    hv1 = tl.load(h_ptr + offs_d1, mask=offs_d1 < DM, other=0.0).to(tl.float32)
    hv2 = tl.load(h_ptr + offs_d2, mask=offs_d2 < DM, other=0.0).to(tl.float32)
    rstd = tl.rsqrt((tl.sum(hv1 * hv1, axis=0) + tl.sum(hv2 * hv2, axis=0)) / DM + pre_eps)

    for item in range(vpid, n_items, n_prog):
        nxt = item + n_prog
        n_head, n_p0, n_j, n_rows, n_rmask, n_cc, n_cmask = _item_rows(nxt, n_items, d_inner, GS, H, P, N_SHARED,
                                                                        BLOCK_P)
        n_wt1, n_wt2, n_state, n_hist, n_w_last = _item_loads(
            w_ptr, ss_ptr, cs_ptr, cw_ptr, cb_ptr, nxt, n_items, n_rows, n_rmask, n_cc, n_cmask, n_head, n_p0, DM, P,
            S, swn, shh, shp, shs, scc, sck, swc, swk, in_dtype, N_SHARED, K, HAS_CONV_BIAS, BLOCK_P, BLOCK_S,
            BLOCK_KC, BLOCK_D1, BLOCK_D2)

        head, p0, j, rows, rmask, cc, cmask = _item_rows(item, n_items, d_inner, GS, H, P, N_SHARED, BLOCK_P)
        raw = (tl.sum(wt1.to(tl.float32) * hv1[None, :], axis=1) + tl.sum(wt2.to(tl.float32) * hv2[None, :], axis=1))
        raw = raw * rstd
        if HAS_BIAS:
            raw += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        raw = raw.to(in_dtype).to(tl.float32)  # in_proj's output is rounded, as the reference's is
        conv = hist + raw * w_last
        post = (conv * tl.sigmoid(conv)).to(in_dtype).to(tl.float32)  # silu, rounded as the conv output
        if not TAIL:  # timing only (bench/layer_step_probe.py): the dot products without the step
            tl.store(g_ptr + (cc % d_inner), (raw + post).to(in_dtype), mask=rmask & (cc < d_inner))
        elif item < N_SHARED:
            # Publish B and C convolved and dt raw, shift B/C's conv state (no head item reads
            # it), then count this item done. The barrier orders every thread's stores before
            # the releasing atomic.
            tl.store(shared_ptr + j, tl.where(cmask, post, raw), mask=j < 2 * GS + H)
            _shift_in(cs_ptr, cc, cmask, raw, scc, sck, K, BLOCK_KC)
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + 1, 1, sem="release")
        else:
            z, x_in = tl.split(tl.reshape(raw, [BLOCK_P, 2]))
            z_conv, x = tl.split(tl.reshape(post, [BLOCK_P, 2]))
            if WAIT:  # False only to time what the wait costs (bench/layer_step_probe.py): wrong results
                target = (epoch + 1) * N_SHARED
                done = tl.load(sync_ptr + 1, volatile=True)  # poll with plain loads, then one acquiring atomic
                while done < target:
                    done = tl.load(sync_ptr + 1, volatile=True)
                tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
            grp = head // heads_per_group
            Bv = tl.load(shared_ptr + grp * S + offs_s, mask=offs_s < S, other=0.0, cache_modifier=".cg")
            Cv = tl.load(shared_ptr + GS + grp * S + offs_s, mask=offs_s < S, other=0.0, cache_modifier=".cg")
            dt_raw = tl.load(shared_ptr + 2 * GS + head, cache_modifier=".cg")
            dt_b = tl.load(dtb_ptr + head).to(tl.float32)
            A = -tl.exp(tl.load(Alog_ptr + head).to(tl.float32))
            Dh = tl.load(D_ptr + head).to(tl.float32)
            dt = tl.minimum(tl.maximum(_softplus(dt_raw + dt_b), dt_min), dt_max)
            new_state = state * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
            y = tl.sum(new_state * Cv[None, :], axis=1) + x * Dh
            gated = y.to(in_dtype).to(tl.float32) * (z * tl.sigmoid(z))
            offs_pp = p0 + tl.arange(0, BLOCK_P)
            tl.store(g_ptr + head * P + offs_pp, gated, mask=offs_pp < P)
            _shift_in(cs_ptr, cc, cmask, raw, scc, sck, K, BLOCK_KC)  # this item owns its x channels
            tl.store(ss_ptr + head * shh + offs_pp[:, None] * shp + offs_s[None, :] * shs, new_state,
                     mask=(offs_pp < P)[:, None] & (offs_s < S)[None, :])
        wt1, wt2, state, hist, w_last = n_wt1, n_wt2, n_state, n_hist, n_w_last


def _fusable(h, in_weight, conv_state, ssm_state, conv_weight, n_groups) -> bool:
    batch, heads, head_dim, d_state = ssm_state.shape
    d_inner = heads * head_dim
    conv_dim = d_inner + 2 * n_groups * d_state
    return (FUSED and batch == 1 and h.numel() == in_weight.shape[1] and in_weight.stride(-1) == 1
            and tuple(in_weight.shape) == (2 * d_inner + 2 * n_groups * d_state + heads, h.numel())
            and tuple(conv_weight.shape[:1]) == (conv_dim,) and conv_weight.shape[1] >= 2
            and ssm_state.dtype == torch.float32 and tuple(conv_state.shape) == (1, conv_dim, conv_weight.shape[1] - 1)
            and (h.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"))


def mamba_layer_step(h, in_weight, in_bias, pre_eps, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                     n_groups, norm_groups, dt_min, dt_max, eps, out_weight, out_bias):
    """h + mixer(RMSNorm(h)) for one token; same contract as `naive_mamba_layer_step`.

    At batch 1: in_proj with the step inside it (`_in_proj_step_kernel`), then out_proj with the
    gated norm inside and the residual add (ops/step_update `_launch_out_proj`). Otherwise the
    unfused kernels: `norm_linear`, then `mamba_step_out`.
    """
    from ..gemv.triton import norm_linear
    from ..step_update.triton import mamba_step_out

    batch, heads, head_dim, d_state = ssm_state.shape
    d_inner = heads * head_dim
    h2 = h.reshape(batch, -1)
    if not _fusable(h2, in_weight, conv_state, ssm_state, conv_weight, n_groups):
        proj = norm_linear(h2, in_weight, in_bias, 1, pre_eps)
        z, xBC, dt_raw = proj.split([d_inner, conv_weight.shape[0], heads], dim=-1)
        return mamba_step_out(xBC, dt_raw, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D, None,
                              n_groups, norm_groups, dt_min, dt_max, eps, out_weight, out_bias, residual=h2)
    gated = in_proj_step(h2, in_weight, in_bias, pre_eps, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log,
                         D, n_groups, dt_min, dt_max)
    return _launch_out_proj(gated, None, conv_state, out_weight, out_bias, h2, norm_groups, eps, n_groups, d_state,
                            conv_weight.shape[1], shift_bc=False, reset=None if TICKET else _flag(in_weight))


def in_proj_step(h, in_weight, in_bias, pre_eps, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A_log, D,
                 n_groups, dt_min, dt_max):
    """The first launch of `mamba_layer_step`: h (1, D) -> the gated value y * silu(z), (1, H*P) in
    h's dtype, before the gated norm; conv and SSM states updated in place."""
    batch, heads, head_dim, d_state = ssm_state.shape
    d_inner = heads * head_dim
    hv = h.reshape(-1)
    if hv.stride(0) != 1:
        hv = hv.contiguous()
    d_model = hv.numel()
    kernel_size = conv_weight.shape[1]
    rows = 2 * BLOCK_P
    n_shared = triton.cdiv(2 * n_groups * d_state + heads, rows)
    n_prog = _grid(n_shared + heads * triton.cdiv(head_dim, BLOCK_P), h.device)
    gated = torch.empty(1, d_inner, device=h.device, dtype=h.dtype)
    shared = torch.empty(2 * n_groups * d_state + heads, device=h.device, dtype=torch.float32)
    block_d1, block_d2 = _row_pieces(d_model)
    use_pdl = pdl.enabled(h.device)
    _in_proj_step_kernel[(n_prog,)](
        hv, in_weight, in_bias if in_bias is not None else in_weight, conv_state, ssm_state, conv_weight,
        conv_bias if conv_bias is not None else conv_weight, dt_bias, A_log, D, gated, shared,
        _counters(in_weight, n_prog) if TICKET else _counters(in_weight, 0),
        d_model, float(pre_eps), heads, head_dim, d_state, n_groups, heads // n_groups, float(dt_min), float(dt_max),
        in_weight.stride(0), conv_state.stride(1), conv_state.stride(2), *ssm_state.stride()[1:], *conv_weight.stride(),
        K=kernel_size, HAS_BIAS=in_bias is not None, HAS_CONV_BIAS=conv_bias is not None,
        BLOCK_P=BLOCK_P, BLOCK_S=max(16, triton.next_power_of_2(d_state)),
        BLOCK_KC=max(2, triton.next_power_of_2(kernel_size - 1)), BLOCK_D1=block_d1, BLOCK_D2=block_d2,
        N_SHARED=n_shared, USE_PDL=use_pdl, WAIT=WAIT, TICKET=TICKET, TAIL=TAIL, num_warps=NUM_WARPS,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return gated
