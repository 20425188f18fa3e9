"""A folded Mamba-2 sublayer at batch 1 in two launches: in_proj with the step inside it, then
out_proj; `naive.py` is the spec.

The unfused route is three launches per layer: the in_proj GEMV, the step kernel (conv update,
state update, gate) and the out_proj GEMV. The step kernel needs in_proj's B and C rows, which
every head shares, so it could only start once all of in_proj had finished; on the H100 it
left the weight stream idle for ~5.5 us per layer (BENCHMARKS.md, round 3's timeline).

Here in_proj's rows are dealt out by head. A head program owns BLOCK_P channels of one head:
their z and x rows and the head's dt row (so the x channels' conv and the whole state update
of its (BLOCK_P, S) slice need nothing from other programs) and streams those rows' weights
like a GEMV. The 2*G*S rows of B and C go to N_BC programs of their own, which convolve them,
publish them to a small buffer and count themselves done on a flag. A head program waits on
that flag only after its own weight stream, by which time the B/C programs, which started
first, are long finished. So the step's latency moves under the stream, apart from the last
head programs' tails.

Roles come from a ticket (an atomic counter) rather than the program id: the programs that
take the first tickets of a launch are running, so the B/C work a head program waits for
always belongs to a program that has started, whatever order the hardware dispatches them in.
Both counters only grow (int64): launch e of a layer hands out tickets e*n .. e*n + n - 1 and
its head programs wait for the flag to reach (e + 1) * N_BC. Nothing has to reset them, so an
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
BLOCK_P = 16
"""x channels (and z rows) per head program: 2 * BLOCK_P weight rows plus the head's dt row."""
BLOCK_D = 512
"""Columns of d_model per weight chunk; the next chunk is loaded while this one is reduced."""
NUM_WARPS = 8

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
def _in_proj_step_kernel(
    h_ptr, w_ptr, b_ptr, cs_ptr, ss_ptr, cw_ptr, cb_ptr, dtb_ptr, Alog_ptr, D_ptr,
    g_ptr, bc_ptr, sync_ptr,
    DM, pre_eps, H, P, S, G, heads_per_group, dt_min, dt_max,
    swn, scc, sck, shh, shp, shs, swc, swk,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_CONV_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_KC: tl.constexpr, BLOCK_D: tl.constexpr,
    N_CHUNKS: tl.constexpr, N_BC: tl.constexpr, USE_PDL: tl.constexpr,
):
    R: tl.constexpr = 2 * BLOCK_P
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now
        gdc_launch_dependents()
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")  # see the module docstring
    n_prog = tl.num_programs(0)
    epoch = ticket // n_prog
    role = (ticket % n_prog).to(tl.int32)
    is_bc = role < N_BC
    d_inner = H * P
    GS = G * S
    in_dtype = h_ptr.dtype.element_ty

    # Lane i of the R rows. A head program interleaves its z rows (even lanes) and x rows (odd
    # lanes), channel p = i // 2 of its block; a B/C program takes R consecutive B/C rows.
    i = tl.arange(0, R)
    pblocks = tl.cdiv(P, BLOCK_P)
    u = tl.maximum(role - N_BC, 0)
    head = u // pblocks
    p0 = (u % pblocks) * BLOCK_P
    is_x = (i % 2) == 1
    head_ch = head * P + p0 + i // 2
    head_ok = p0 + i // 2 < P
    bc = role * R + i
    bc_ok = bc < 2 * GS
    bc_lanes = (i * 0 + role) < N_BC  # is_bc as a block (the interpreter masks with blocks only)
    rows = tl.where(bc_lanes, 2 * d_inner + bc, tl.where(is_x, d_inner + head_ch, head_ch))
    rmask = tl.where(bc_lanes, bc_ok, head_ok)
    cc = tl.where(bc_lanes, d_inner + bc, head_ch)  # conv channels (xBC index) of the lanes
    cmask = tl.where(bc_lanes, bc_ok, head_ok & is_x)
    dt_row = 2 * d_inner + 2 * GS + head

    # Everything that no kernel of this step writes before us, read before the PDL wait: the
    # first weight chunk, the head's (BLOCK_P, S) state slice, the conv history and taps, the
    # per-head constants. States were last written by this layer's previous step or by replay;
    # every step starts with the embedding lookup, a plain launch that waits for all earlier work.
    offs_d = tl.arange(0, BLOCK_D)
    w_rows = w_ptr + rows[:, None] * swn
    dt_lanes = (offs_d * 0 + role) >= N_BC
    wt = tl.load(w_rows + offs_d[None, :], mask=rmask[:, None] & (offs_d < DM)[None, :], other=0.0,
                 eviction_policy="evict_first")
    wd = tl.load(w_ptr + dt_row * swn + offs_d, mask=dt_lanes & (offs_d < DM), other=0.0, eviction_policy="evict_first")
    offs_pp = p0 + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    head_pp = (offs_pp < P) & ((offs_pp * 0 + role) >= N_BC)
    s_ptrs = ss_ptr + head * shh + offs_pp[:, None] * shp + offs_s[None, :] * shs
    s_mask = head_pp[:, None] & (offs_s < S)[None, :]
    state = tl.load(s_ptrs, mask=s_mask, other=0.0)
    hist, w_last = _conv_history(cs_ptr, cw_ptr, cc, cmask, in_dtype, scc, sck, swc, swk, K, BLOCK_KC)
    if HAS_CONV_BIAS:
        hist += tl.load(cb_ptr + cc, mask=cmask, other=0.0).to(tl.float32)
    dt_b = tl.load(dtb_ptr + head).to(tl.float32)
    A = -tl.exp(tl.load(Alog_ptr + head).to(tl.float32))
    Dh = tl.load(D_ptr + head).to(tl.float32)
    if USE_PDL:
        gdc_wait()

    # The GEMV: h's RMSNorm scales the dot products at the end (its weight is folded into w).
    # Each chunk is reduced as it arrives: a (R, BLOCK_D) fp32 accumulator would hold 64 more
    # registers per thread and keep the grid from fitting on the GPU in one wave.
    acc = tl.zeros([R], dtype=tl.float32)
    acc_dt = 0.0
    sq = 0.0
    for c in tl.static_range(N_CHUNKS):
        if c + 1 < N_CHUNKS:  # the next chunk's loads go out before this chunk's multiply-adds
            offs_n = (c + 1) * BLOCK_D + offs_d
            wt_next = tl.load(w_rows + offs_n[None, :], mask=rmask[:, None] & (offs_n < DM)[None, :], other=0.0,
                              eviction_policy="evict_first")
            wd_next = tl.load(w_ptr + dt_row * swn + offs_n, mask=dt_lanes & (offs_n < DM), other=0.0,
                              eviction_policy="evict_first")
        offs_c = c * BLOCK_D + offs_d
        hv = tl.load(h_ptr + offs_c, mask=offs_c < DM, other=0.0).to(tl.float32)
        acc += tl.sum(wt.to(tl.float32) * hv[None, :], axis=1)
        acc_dt += tl.sum(wd.to(tl.float32) * hv, axis=0)
        sq += tl.sum(hv * hv, axis=0)
        if c + 1 < N_CHUNKS:
            wt = wt_next
            wd = wd_next
    rstd = tl.rsqrt(sq / DM + pre_eps)
    raw = acc * rstd
    dt_raw = acc_dt * rstd
    if HAS_BIAS:
        raw += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        dt_raw += tl.load(b_ptr + dt_row).to(tl.float32)
    raw = raw.to(in_dtype).to(tl.float32)  # in_proj's output is rounded, as the reference's is
    dt_raw = dt_raw.to(in_dtype).to(tl.float32)
    conv = hist + raw * w_last
    post = (conv * tl.sigmoid(conv)).to(in_dtype).to(tl.float32)  # silu, rounded as the conv output

    if role < N_BC:
        # Publish the convolved B/C values, shift their conv state (no head program reads it),
        # then count this program done. The barrier orders every thread's stores before the
        # releasing atomic.
        tl.store(bc_ptr + bc, post, mask=cmask)
        _shift_in(cs_ptr, cc, cmask, raw, scc, sck, K, BLOCK_KC)
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release")
    else:
        z, x_in = tl.split(tl.reshape(raw, [BLOCK_P, 2]))
        z_conv, x = tl.split(tl.reshape(post, [BLOCK_P, 2]))
        dt = tl.minimum(tl.maximum(_softplus(dt_raw + dt_b), dt_min), dt_max)
        target = (epoch + 1) * N_BC
        done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        while done < target:
            done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
        grp = head // heads_per_group
        Bv = tl.load(bc_ptr + grp * S + offs_s, mask=offs_s < S, other=0.0, cache_modifier=".cg")
        Cv = tl.load(bc_ptr + GS + grp * S + offs_s, mask=offs_s < S, other=0.0, cache_modifier=".cg")
        state = state * tl.exp(dt * A) + (dt * x)[:, None] * Bv[None, :]
        y = tl.sum(state * Cv[None, :], axis=1) + x * Dh
        gated = y.to(in_dtype).to(tl.float32) * (z * tl.sigmoid(z))
        tl.store(g_ptr + head * P + offs_pp, gated, mask=head_pp)
        _shift_in(cs_ptr, cc, cmask, raw, scc, sck, K, BLOCK_KC)  # this program owns its x channels
        tl.store(s_ptrs, state, mask=s_mask)


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
                            conv_weight.shape[1], shift_bc=False)


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
    n_bc = triton.cdiv(2 * n_groups * d_state, 2 * BLOCK_P)
    n_prog = n_bc + heads * triton.cdiv(head_dim, BLOCK_P)
    gated = torch.empty(1, d_inner, device=h.device, dtype=h.dtype)
    bc = torch.empty(2 * n_groups * d_state, device=h.device, dtype=torch.float32)
    block_d = min(BLOCK_D, triton.next_power_of_2(d_model))
    use_pdl = pdl.enabled(h.device)
    _in_proj_step_kernel[(n_prog,)](
        hv, in_weight, in_bias if in_bias is not None else in_weight, conv_state, ssm_state, conv_weight,
        conv_bias if conv_bias is not None else conv_weight, dt_bias, A_log, D, gated, bc, _counters(in_weight, n_prog),
        d_model, float(pre_eps), heads, head_dim, d_state, n_groups, heads // n_groups, float(dt_min), float(dt_max),
        in_weight.stride(0), conv_state.stride(1), conv_state.stride(2), *ssm_state.stride()[1:], *conv_weight.stride(),
        K=kernel_size, HAS_BIAS=in_bias is not None, HAS_CONV_BIAS=conv_bias is not None,
        BLOCK_P=BLOCK_P, BLOCK_S=max(16, triton.next_power_of_2(d_state)),
        BLOCK_KC=max(2, triton.next_power_of_2(kernel_size - 1)), BLOCK_D=block_d,
        N_CHUNKS=triton.cdiv(d_model, block_d), N_BC=n_bc, USE_PDL=use_pdl, num_warps=NUM_WARPS,
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return gated
