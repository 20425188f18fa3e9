"""Triton kernel of the packed-tree SSM scan; `naive.py` beside it is the spec.

One program per (batch row, head, block of P channels). The tree is small (N <= a few hundred),
so the kernel uses the quadratic masked form of `naive_tree_scan` on chip instead of a
sequential walk with a per-node state: a sequential walk would need every node's (P, S) state
kept until its last child is done (a stack with run-time indexing, which Triton cannot keep in
registers), while the masked form is three small matrix products whose operands fit on chip.
Per-node states never reach global memory; the only large read is the initial state (P, S).

The ancestor mask and the path-summed log-decay are built in the kernel by walking each node's
parent chain, so `parents` stays a device tensor and nothing syncs with the host.

`tree_scan_gated` is the same kernel with the verify path's neighbours folded in (FUSED): the
time step softplus(dt_raw + dt_bias), clamped, is computed per node inside each program (every
P block of a head recomputes its head's N values, cheaper than a launch), and the output is
gated by silu(z) and stored in z's dtype. Two launches fewer per Mamba layer.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import gdc_launch_dependents, gdc_wait, pdl_args, softplus


@triton.jit
def _ancestors(par_ptr, offs_n, mask_n, N, anc):
    """anc[i, j] = 1 where node j is on node i's root path (i included): every node's parent
    chain walked at once, cur[i] being node i's k-th ancestor after step k."""
    cur = tl.where(mask_n, offs_n, -1)
    steps = 0
    while (tl.max(cur, axis=0) >= 0) & (steps < N):  # the step bound guards a malformed parents
        valid = cur >= 0
        anc = tl.where(cur[:, None] == offs_n[None, :], 1, anc)
        cur = tl.where(valid, tl.load(par_ptr + cur, mask=valid, other=-1).to(tl.int32), -1)
        steps += 1
    return anc


@triton.jit
def _ancestor_mask(par_ptr, offs_n, mask_n, N, BLOCK_N: tl.constexpr):
    """`_ancestors`' mask, without the walk for a chain (parents -1, 0, 1, ...: a prefill chunk),
    whose mask is the lower triangle: a 64-token chunk would walk 64 levels, one dependent load and
    one block reduction each, in every layer. Verify trees (depth 3-8) take the walk."""
    par = tl.load(par_ptr + offs_n, mask=mask_n, other=-1).to(tl.int32)
    links = tl.where(mask_n, (par == offs_n - 1).to(tl.int32), 1)
    if tl.min(links, axis=0) == 1:
        anc = ((offs_n[None, :] <= offs_n[:, None]) & mask_n[:, None]).to(tl.int32)
    else:
        anc = _ancestors(par_ptr, offs_n, mask_n, N, tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.int32))
    return anc


@triton.jit
def _tree_scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, par_ptr, h0_ptr, y_ptr,
    bias_ptr, z_ptr, dt_out_ptr, dt_min, dt_max,
    N, H, P, S, heads_per_group,
    sxb, sxn, sxh, sxp,
    sdb, sdn, sdh,
    sBb, sBn, sBg, sBs,
    sCb, sCn, sCg, sCs,
    shb, shh, shp, shs,
    syb, syn, syh, syp,
    szb, szn, szc,
    HAS_D: tl.constexpr,
    FUSED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr, ONE_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    sq_ptr=None, WRITE_SQ: tl.constexpr = False,
    px_ptr=None, pdt_ptr=None, pB_ptr=None, count_ptr=None, L=0,
    spxb=0, spxl=0, spxh=0, spxp=0, spdb=0, spdl=0, spdh=0, spBb=0, spBl=0, spBg=0, spBs=0,
    HAS_PENDING: tl.constexpr = False, BLOCK_L: tl.constexpr = 16,
    gate_flag_ptr=None, WAIT_GATE: tl.constexpr = False,
):
    # WAIT_GATE (FUSED): z comes from a GEMM on another stream that runs beside this launch
    # (ops/overlap.py); it is read once this head's ready counter shows it stored: looked at
    # before the last products, waited for at the gate if it was not ready then. The next
    # kernel may launch only once no wait is ahead: its early programs would otherwise hold
    # the SMs that z's GEMM needs.
    if USE_PDL and not WAIT_GATE:  # ops/pdl.py: the next kernel may launch now
        gdc_launch_dependents()
    pid_bh = tl.program_id(0)
    pid_p = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    g = h // heads_per_group
    offs_n = tl.arange(0, BLOCK_N)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_s = tl.arange(0, BLOCK_S)
    mask_n = offs_n < N
    mask_p = offs_p < P

    A = tl.load(A_ptr + h).to(tl.float32)
    dt_base = dt_ptr + b * sdb + h * sdh
    B_base = B_ptr + b * sBb + g * sBg
    C_base = C_ptr + b * sCb + g * sCg
    h0_base = h0_ptr + b * shb + h * shh
    mask_np = mask_n[:, None] & mask_p[None, :]

    # Before the PDL wait, everything that no earlier kernel of this verify writes: the tree walk
    # (parents only), the first S chunk of the initial state (all of it when ONE_CHUNK), D and
    # dt_bias. The state was last written by a replay or step before this verify's embedding
    # lookup, a plain launch that waits for all earlier work.
    anc = _ancestor_mask(par_ptr, offs_n, mask_n, N, BLOCK_N)
    h0_first = tl.load(h0_base + offs_p[:, None] * shp + offs_s[None, :] * shs,
                       mask=mask_p[:, None] & (offs_s < S)[None, :], other=0.0).to(tl.float32)
    if HAS_D:
        D = tl.load(D_ptr + h).to(tl.float32)
    if FUSED:
        dt_b = tl.load(bias_ptr + h).to(tl.float32)
    if HAS_PENDING:
        # The pending inputs (ReplaySSM, models/cache.py) come between h0 and the root: the
        # tree reads h0' = exp(sum a) h0 + sum_j w_j x_j B_j^T, with w_j = dt_j exp(sum_{k>j} a_k)
        # over the valid slots (a = dt A). Written by the last replay, like h0: loaded before
        # the PDL wait too. Slots past the count load dt = 0, which makes them no-ops.
        count = tl.load(count_ptr + b).to(tl.int32)
        offs_l = tl.arange(0, BLOCK_L)
        mask_l = offs_l < tl.minimum(count, L)
        pdt = tl.load(pdt_ptr + b * spdb + offs_l * spdl + h * spdh, mask=mask_l, other=0.0).to(tl.float32)
        px = tl.load(px_ptr + b * spxb + offs_l[:, None] * spxl + h * spxh + offs_p[None, :] * spxp,
                     mask=mask_l[:, None] & mask_p[None, :], other=0.0)
        pB_base = pB_ptr + b * spBb + g * spBg
        if ONE_CHUNK:
            pB = tl.load(pB_base + offs_l[:, None] * spBl + offs_s[None, :] * spBs,
                         mask=mask_l[:, None] & (offs_s < S)[None, :], other=0.0)
    if USE_PDL:  # wait for the previous kernel before reading activations or writing anything
        gdc_wait()

    # Every activation load is issued here, before any of them is used: the kernel is latency
    # bound (one program per head), and issuing them in use order cost one L2 round trip each.
    # B and C stay in their dtype: C.B^T of bf16 tiles on the tensor cores is exact products
    # with fp32 sums, as the TF32 product of their fp32 copies is.
    dt = tl.load(dt_base + offs_n * sdn, mask=mask_n, other=0.0).to(tl.float32)
    if FUSED and not WAIT_GATE:
        # The gate's z is kept in its own dtype until the gate (fewer registers: measured faster
        # than either loading it at the gate or holding it in fp32).
        zm = tl.load(z_ptr + b * szb + offs_n[:, None] * szn + (h * P + offs_p[None, :]) * szc, mask=mask_np,
                     other=0.0)
    xm = tl.load(x_ptr + b * sxb + h * sxh + offs_n[:, None] * sxn + offs_p[None, :] * sxp, mask=mask_np,
                 other=0.0)
    if ONE_CHUNK:
        mask_ns = mask_n[:, None] & (offs_s < S)[None, :]
        Cm = tl.load(C_base + offs_n[:, None] * sCn + offs_s[None, :] * sCs, mask=mask_ns, other=0.0)
        Bm = tl.load(B_base + offs_n[:, None] * sBn + offs_s[None, :] * sBs, mask=mask_ns, other=0.0)
    if FUSED:
        # dt_ptr is dt_raw: the time step of every node here (padding lanes stay 0), stored for
        # replay by the P-block-0 program.
        dt = softplus(dt + dt_b)
        dt = tl.where(mask_n, tl.minimum(tl.maximum(dt, dt_min), dt_max), 0.0)
        if pid_p == 0:
            tl.store(dt_out_ptr + (b * N + offs_n) * H + h, dt, mask=mask_n)
    if HAS_PENDING:
        p_log = pdt * A
        p_total = tl.sum(p_log, axis=0)
        p_w = pdt * tl.exp(p_total - tl.cumsum(p_log, axis=0))  # each slot's weight in h0'
        p_decay = tl.exp(p_total)
        # Not h0' itself, (P, S), but its readout C.h0' = p_decay C.h0 + sum_j p_w_j (C.B_j) x_j:
        # (N, L) scores, cheaper (building h0' measured 4-5x slower on an H100).
        if ONE_CHUNK:
            p_scores = tl.dot(Cm, tl.trans(pB), input_precision=PRECISION)
        else:
            p_scores = tl.zeros([BLOCK_N, BLOCK_L], dtype=tl.float32)
    # acum[i] = sum of dt*A along node i's path (its log-decay from the prefix), through the
    # ancestor mask: dt is in registers already, cheaper than gathering it along each chain.
    acum = tl.sum(tl.where(anc != 0, dt[None, :] * A, 0.0), axis=1)

    # scores[i, j] = C_i . B_j and the initial-state term C_i . h0[p, :]; with more state than
    # one chunk, accumulated over S chunks so that the operands stay small whatever S is.
    if ONE_CHUNK:
        scores = tl.dot(Cm, tl.trans(Bm), input_precision=PRECISION)
        from_h0 = tl.dot(Cm.to(tl.float32), tl.trans(h0_first), input_precision=PRECISION)
    else:
        scores = tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.float32)
        from_h0 = tl.zeros([BLOCK_N, BLOCK_P], dtype=tl.float32)
        # a dynamic loop: unrolled (tl.static_range) it measured 12.3 against 9.6 us at 64 nodes
        for s0 in range(0, S, BLOCK_S):
            ss = s0 + offs_s
            mask_s = ss < S
            Cc = tl.load(C_base + offs_n[:, None] * sCn + ss[None, :] * sCs,
                         mask=mask_n[:, None] & mask_s[None, :], other=0.0).to(tl.float32)
            Bc = tl.load(B_base + offs_n[:, None] * sBn + ss[None, :] * sBs,
                         mask=mask_n[:, None] & mask_s[None, :], other=0.0).to(tl.float32)
            if s0 == 0:
                h0 = h0_first
            else:
                h0 = tl.load(h0_base + offs_p[:, None] * shp + ss[None, :] * shs,
                             mask=mask_p[:, None] & mask_s[None, :], other=0.0).to(tl.float32)
            if HAS_PENDING:
                pB = tl.load(pB_base + offs_l[:, None] * spBl + ss[None, :] * spBs,
                             mask=mask_l[:, None] & mask_s[None, :], other=0.0).to(tl.float32)
                p_scores += tl.dot(Cc, tl.trans(pB), input_precision=PRECISION)
            scores += tl.dot(Cc, tl.trans(Bc), input_precision=PRECISION)
            from_h0 += tl.dot(Cc, tl.trans(h0), input_precision=PRECISION)

    if WAIT_GATE:
        # A first look at z's ready counter, and z's load on its strength, issued here so that
        # both overlap the products below: if z was ready, nothing waits at the gate.
        ready = tl.atomic_add(gate_flag_ptr + h, 0, sem="acquire")
        zm = tl.load(z_ptr + b * szb + offs_n[:, None] * szn + (h * P + offs_p[None, :]) * szc, mask=mask_np,
                     other=0.0, cache_modifier=".cg")
        if USE_PDL:
            if ready >= 1:  # no wait ahead: the next kernel may launch now
                gdc_launch_dependents()
    # Weight of node j's input in node i's output: C_i.B_j * exp(acum_i - acum_j) * dt_j on i's path.
    seg = tl.where(anc != 0, acum[:, None] - acum[None, :], float("-inf"))
    w = scores * tl.exp(seg) * dt[None, :]
    xm = xm.to(tl.float32)
    if HAS_PENDING:
        from_h0 = from_h0 * p_decay + tl.dot(p_scores * p_w[None, :], px.to(tl.float32), input_precision=PRECISION)
    y = tl.dot(w, xm, input_precision=PRECISION) + from_h0 * tl.exp(acum)[:, None]
    if HAS_D:
        y += xm * D
    if WAIT_GATE:
        if ready < 1:  # z was not ready at the first look: wait for it, then read it again
            while ready < 1:
                ready = tl.atomic_add(gate_flag_ptr + h, 0, sem="acquire")
            if USE_PDL:
                gdc_launch_dependents()
            # past L1 (".cg"): z is written by another launch while this one runs
            zm = tl.load(z_ptr + b * szb + offs_n[:, None] * szn + (h * P + offs_p[None, :]) * szc, mask=mask_np,
                         other=0.0, cache_modifier=".cg")
        tl.atomic_add(gate_flag_ptr + h, -1, sem="relaxed")  # back to 0 once every reader has passed
    if FUSED:
        # g = y * silu(z) with y rounded to z's (= the output's) dtype first, as the reference does.
        zf = zm.to(tl.float32)
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) * (zf * tl.sigmoid(zf))
    out = y.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + b * syb + h * syh + offs_n[:, None] * syn + offs_p[None, :] * syp, out, mask=mask_np)
    if WRITE_SQ:
        # Each node's sum of squares over this program's channels, for out_proj's gated norm
        # (ops/gemv norm_linear x_sq): at (b, node, h * P blocks + pid_p), so the parts of one
        # norm group (its heads) are contiguous.
        of = tl.where(mask_np, out.to(tl.float32), 0.0)
        tl.store(sq_ptr + (b * N + offs_n) * (H * tl.num_programs(1)) + h * tl.num_programs(1) + pid_p,
                 tl.sum(of * of, axis=1), mask=mask_n)


def _check_tree_scan_shapes(x, dt, A, B, C, D, parents, initial_state, op="tree_scan"):
    batch, n, heads, head_dim = x.shape
    groups, d_state = B.shape[2], B.shape[3]
    expected = {
        "dt": (dt.shape, (batch, n, heads)),
        "A": (A.shape, (heads,)),
        "B": (B.shape, (batch, n, groups, d_state)),
        "C": (C.shape, (batch, n, groups, d_state)),
        "parents": (parents.shape, (n,)),
        "initial_state": (initial_state.shape, (batch, heads, head_dim, d_state)),
    }
    if D is not None:
        expected["D"] = (D.shape, (heads,))
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"{op}: {name} has shape {tuple(got)}, expected {want}")
    if heads % groups:
        raise ValueError(f"{op}: {heads} heads do not split into {groups} groups")


def _check_pending(pending, initial_state, B, op="tree_scan"):
    if pending is None:
        return
    x, dt, pB, count = pending
    batch, heads, head_dim, d_state = initial_state.shape
    capacity = x.shape[1]
    expected = {"x": (x.shape, (batch, capacity, heads, head_dim)), "dt": (dt.shape, (batch, capacity, heads)),
                "B": (pB.shape, (batch, capacity, B.shape[2], d_state)), "count": (count.shape, (batch,))}
    for name, (got, want) in expected.items():
        if tuple(got) != want:
            raise ValueError(f"{op}: pending {name} has shape {tuple(got)}, expected {want}")


def tree_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    parents: torch.Tensor,
    initial_state: torch.Tensor,
    precision: str | None = None,
    pending=None,
) -> torch.Tensor:
    """Output of every tree node as if its root-to-node path had been scanned alone.

    Same contract as `naive_tree_scan`; `precision` is Triton's dot precision for the fp32
    operands: "ieee" matches the reference to fp32 rounding, "tf32" is ~3-5x faster on tensor
    cores (relative error ~3e-4). None picks "ieee" for fp32 inputs and "tf32" for bf16/fp16
    inputs, whose own rounding is coarser than tf32's.

    Args:
        x: (B, N, H, P) SSM inputs after the conv.
        dt: (B, N, H) time steps after softplus and clamp.
        A: (H,) negative decay rates.
        B, C: (B, N, G, S).
        D: (H,) or None.
        parents: (N,) int, -1 for the root, parents before children.
        initial_state: (B, H, P, S) the state before the root (before the pending inputs).
        pending: None, or (x, dt, B, count): the pending inputs between initial_state
            and the root (ReplaySSM, models/cache.py); read, never written.
    Returns:
        y: (B, N, H, P) fp32.
    """
    _check_tree_scan_shapes(x, dt, A, B, C, D, parents, initial_state)
    _check_pending(pending, initial_state, B)
    batch, n, heads, head_dim = x.shape
    y = torch.empty(batch, n, heads, head_dim, device=x.device, dtype=torch.float32)
    _launch(x, dt, A, B, C, D, parents, initial_state, y, precision, pending=pending)
    return y


def tree_scan_gated(
    x: torch.Tensor,
    dt_raw: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_min: float,
    dt_max: float,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor,
    precision: str | None = None,
    return_sq: bool = False,
    pending=None,
    gate_flags=None,
):
    """Time step, tree scan and gate y * silu(z) of the verify path in one launch.

    Same contract as `naive_tree_scan_gated`; `precision` as in `tree_scan`. dt_raw, z, x, B
    and C may be strided views (column slices of the in_proj / conv output). With return_sq
    also the gated output's partial sums of squares per group, (B*N, G, parts) fp32, each
    program's share, for out_proj's gated norm (ops/gemv `norm_linear` x_sq).

    Args:
        x: (B, N, H, P) SSM inputs after the conv.
        dt_raw: (B, N, H) time steps before dt_bias and softplus; dt_bias: (H,).
        dt_min, dt_max: the clamp of the time step.
        A: (H,) negative decay rates.
        B, C: (B, N, G, S).
        D: (H,) or None.
        z: (B, N, H*P) gate.
        parents: (N,) int, -1 for the root, parents before children.
        initial_state: (B, H, P, S) the state before the root (before the pending inputs).
        pending: as in `tree_scan`.
        gate_flags: None, or (H,) int32 ready counters: z is being written by a kernel on
            another stream that adds `gate_readers(...)` to head h's counter once z's head-h
            columns are stored (ops/overlap.py); each program waits for its head's counter
            before reading z, and the counters are back at 0 when this launch ends.
    Returns:
        g: (B, N, H*P) in z's dtype; dt: (B, N, H) fp32, kept for replay; with return_sq, the
        partial sums of squares.
    """
    _check_tree_scan_shapes(x, dt_raw, A, B, C, D, parents, initial_state, op="tree_scan_gated")
    _check_pending(pending, initial_state, B, op="tree_scan_gated")
    batch, n, heads, head_dim = x.shape
    if tuple(dt_bias.shape) != (heads,) or tuple(z.shape) != (batch, n, heads * head_dim):
        raise ValueError(
            f"tree_scan_gated: dt_bias {tuple(dt_bias.shape)} / z {tuple(z.shape)} do not match x {tuple(x.shape)}"
        )
    g = torch.empty(batch, n, heads * head_dim, device=x.device, dtype=z.dtype)
    dt = torch.empty(batch, n, heads, device=x.device, dtype=torch.float32)
    groups = B.shape[2]
    sq = None
    if return_sq:
        parts = heads // groups * triton.cdiv(head_dim, _block_p(head_dim))
        sq = torch.empty(batch * n, groups, parts, device=x.device, dtype=torch.float32)
    if gate_flags is not None and (gate_flags.dtype != torch.int32 or gate_flags.numel() < heads):
        raise ValueError(f"tree_scan_gated: gate_flags must be {heads} int32 counters, got "
                         f"{gate_flags.numel()} {gate_flags.dtype}")
    _launch(x, dt_raw, A, B, C, D, parents, initial_state, g.view(batch, n, heads, head_dim), precision,
            fused=(dt_bias, float(dt_min), float(dt_max), z, dt), sq=sq, pending=pending, gate_flags=gate_flags)
    return (g, dt, sq) if return_sq else (g, dt)


def gate_readers(batch: int, head_dim: int) -> int:
    """How many programs of `tree_scan_gated` read each head's z (and each count down its ready
    counter once): one per batch row and block of channels."""
    return batch * triton.cdiv(head_dim, _block_p(head_dim))


def gated_programs(batch: int, heads: int, head_dim: int) -> int:
    """Programs in a `tree_scan_gated` launch."""
    return heads * gate_readers(batch, head_dim)


SCAN_WARPS: int | None = None
"""Warps per program; None: 4 up to 32 nodes, else 8 (an override for tuning sweeps)."""
SCAN_BLOCK_S: int | None = None
"""State columns per chunk of the C.B and C.h0 products; None: up to 128 up to 32 nodes, else up
to 64 (an override for tuning sweeps; the tests set it to cover several chunks)."""


SCAN_BLOCK_P: int | None = None
"""Channels per program; None: `_block_p`'s choice (an override for tuning sweeps)."""


def _block_p(head_dim: int) -> int:
    # One block of up to 64 channels: splitting P into 32s (more programs) measured slower,
    # 4.4/6.7/13.5 us against 4.0/4.6/9.3 us for 15/31/63 nodes (H100): the cost is
    # the parent walk and the C.B product, which every P block repeats.
    return SCAN_BLOCK_P or min(64, max(16, triton.next_power_of_2(head_dim)))


def _launch(x, dt, A, B, C, D, parents, initial_state, y, precision, fused=None, sq=None, pending=None,
            gate_flags=None):
    """Run `_tree_scan_kernel` into y (B, N, H, P); fused = (dt_bias, dt_min, dt_max, z, dt_out)
    makes dt the raw time step and y the gated output (tree_scan_gated); sq receives the gated
    output's partial sums of squares."""
    if precision is None:
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
    batch, n, heads, head_dim = x.shape
    groups, d_state = B.shape[2], B.shape[3]
    if y.numel() == 0:
        return
    block_n = max(16, triton.next_power_of_2(n))
    block_p = _block_p(head_dim)
    # Up to 32 nodes the whole state in one chunk (ONE_CHUNK: every load issued at once): 2.74
    # against 4.70 us for two chunks at 16 nodes and S = 128 (H100).
    # At 64 nodes two chunks of 64: 9.56 against 11.53 us for one (its fp32 tiles are 4x larger).
    block_s = SCAN_BLOCK_S or min(128 if block_n <= 32 else 64, max(16, triton.next_power_of_2(d_state)))
    grid = (batch * heads, triton.cdiv(head_dim, block_p))
    D_arg = D if D is not None else A  # never read when HAS_D is False
    # the unfused scan never reads the fused-only arguments: any tensor stands in for them
    dt_bias, dt_min, dt_max, z, dt_out = fused if fused is not None else (A, 0.0, 0.0, x, y)
    z_strides = z.stride() if fused is not None else (0, 0, 0)
    _tree_scan_kernel[grid](
        x, dt, A, B, C, D_arg, parents, initial_state, y,
        dt_bias, z, dt_out, dt_min, dt_max,
        n, heads, head_dim, d_state, heads // groups,
        *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *initial_state.stride(), *y.stride(), *z_strides,
        HAS_D=D is not None, FUSED=fused is not None,
        BLOCK_N=block_n, BLOCK_P=block_p, BLOCK_S=block_s,
        PRECISION=precision, ONE_CHUNK=block_s >= d_state,
        num_warps=SCAN_WARPS or (4 if block_n <= 32 else 8), **pdl_args(y.device),
        sq_ptr=sq, WRITE_SQ=sq is not None,
        **_pending_args(pending),
        **({} if gate_flags is None else dict(gate_flag_ptr=gate_flags, WAIT_GATE=True)),
    )


def _pending_args(pending) -> dict:
    """The kernel's pending-input arguments (HAS_PENDING False when there are none)."""
    if pending is None:
        return {}
    x, dt, B, count = pending
    return dict(px_ptr=x, pdt_ptr=dt, pB_ptr=B, count_ptr=count, L=x.shape[1],
                spxb=x.stride(0), spxl=x.stride(1), spxh=x.stride(2), spxp=x.stride(3),
                spdb=dt.stride(0), spdl=dt.stride(1), spdh=dt.stride(2),
                spBb=B.stride(0), spBl=B.stride(1), spBg=B.stride(2), spBs=B.stride(3),
                HAS_PENDING=True, BLOCK_L=max(16, triton.next_power_of_2(x.shape[1])))
