"""A Triton kernel of the SSD scan's forward (inference: no gradient); `naive.py` is the spec.

One program per (batch row, head, block of head channels) walks the sequence in chunks of Q tokens
with its state (P x N, fp32) held on chip: per chunk the intra-chunk part as two tensor-core
products (C B^T masked by the decays, times x), the part from the carried state (C S^T), the D skip,
then the state update (x weighted by dt and the decay to the chunk's end, times B). x, dt, B and C
are read once and y written once; no chunk states go to memory. The result does not depend on the
chunk length (only rounding does), so Q is the kernel's own, not the model's chunk_size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = (64, 64, 4, 2)
"""(tokens a chunk, head channels a program, warps, pipeline stages of the chunk loops: the next
chunk's loads in flight while this one computes)."""
FP32_TILE = (32, 32, 4, 1)
"""The tile for fp32 inputs (exact products, no tensor cores: the correctness path): TILE's would need
230 KB of shared memory at d_state 256 (sm_90 compile, Triton 3.9), at the H100's limit."""


@triton.jit
def _ssd_forward_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, h0_ptr, y_ptr, hT_ptr,
    cum_ptr, dtc_ptr, states_ptr, cb_ptr,
    T, T_END, NC, H, P, N, heads_per_group,
    sxb, sxt, sxh, sdb, sdt, sdh, sBb, sBt, sBg, sCb, sCt, sCg,
    HAS_D: tl.constexpr, HAS_H0: tl.constexpr, IEEE: tl.constexpr, KEEP: tl.constexpr, SUBS: tl.constexpr,
    Q: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr, STAGES: tl.constexpr,
):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = bh % H
    g = h // heads_per_group
    offs_p = tl.program_id(1) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    offs_q = tl.arange(0, Q)
    mp, mn = offs_p < P, offs_n < N
    # every product takes its operands in the inputs' dtype (bf16 on the tensor cores; fp32 inputs: ieee,
    # exact) and accumulates in fp32, as mamba_ssm's kernels do; the state itself stays fp32
    input_precision: tl.constexpr = "ieee" if IEEE else None
    A = tl.load(A_ptr + h).to(tl.float32)
    state_at = ((b * H + h) * P + offs_p[:, None]) * N + offs_n[None, :]  # (b, h, p, n) contiguous
    if HAS_H0:
        S = tl.load(h0_ptr + state_at, mask=mp[:, None] & mn[None, :], other=0.0).to(tl.float32)
    else:
        S = tl.zeros((BP, BN), tl.float32)
    causal = offs_q[:, None] >= offs_q[None, :]
    chunk_cum = tl.sum(tl.zeros((Q,), tl.float32), 0)  # KEEP: the log-decay from the kept chunk's start
    keeps_rows = tl.program_id(1) == 0  # KEEP: one program of each head writes its per-token rows
    keeps_cb = keeps_rows & (h % heads_per_group == 0)  # and one of each group C B^T
    for start in tl.range(0, T_END, Q, num_stages=STAGES):
        t = start + offs_q
        mt = t < T
        dt = tl.load(dt_ptr + b * sdb + t * sdt + h * sdh, mask=mt, other=0.0).to(tl.float32)  # 0 past T: no decay
        cum = tl.cumsum(dt * A, 0)  # (Q,) log-decay from the chunk's start, non-increasing
        total = tl.sum(dt * A, 0)
        x = tl.load(x_ptr + b * sxb + t[:, None] * sxt + h * sxh + offs_p[None, :], mask=mt[:, None] & mp[None, :],
                    other=0.0)
        Bq = tl.load(B_ptr + b * sBb + t[:, None] * sBt + g * sBg + offs_n[None, :], mask=mt[:, None] & mn[None, :],
                     other=0.0)
        Cq = tl.load(C_ptr + b * sCb + t[:, None] * sCt + g * sCg + offs_n[None, :], mask=mt[:, None] & mn[None, :],
                     other=0.0)
        scores = tl.dot(Cq, tl.trans(Bq), input_precision=input_precision)  # (Q, Q): C_i . B_j
        if KEEP:  # what mamba_ssm's backward reads, per kept chunk of SUBS * Q tokens
            sub = (start // Q) % SUBS
            c = start // (Q * SUBS)
            if sub == 0:
                chunk_cum = chunk_cum * 0.0
                tl.store(states_ptr + (((b * NC + c) * H + h) * P + offs_p[:, None]) * N + offs_n[None, :], S,
                         mask=mp[:, None] & mn[None, :])  # the state entering the chunk
            if keeps_rows:
                row = ((b * H + h) * NC + c) * (Q * SUBS) + sub * Q + offs_q
                tl.store(cum_ptr + row, chunk_cum + cum)
                tl.store(dtc_ptr + row, dt)
            if keeps_cb:
                block = ((b * NC + c) * (H // heads_per_group) + g) * (Q * SUBS) * (Q * SUBS) \
                    + (sub * Q + offs_q[:, None]) * (Q * SUBS) + offs_q[None, :]
                tl.store(cb_ptr + block + sub * Q, scores)
                for r in tl.static_range(SUBS - 1):  # C here against B earlier in the chunk; B later against C here: 0
                    if r < sub:
                        tb = c * Q * SUBS + r * Q + offs_q
                        Br = tl.load(B_ptr + b * sBb + tb[:, None] * sBt + g * sBg + offs_n[None, :],
                                     mask=(tb < T)[:, None] & mn[None, :], other=0.0)
                        tl.store(cb_ptr + block + r * Q, tl.dot(Cq, tl.trans(Br), input_precision=input_precision))
                        tl.store(cb_ptr + block + (r - sub) * Q * (Q * SUBS) + sub * Q, tl.zeros((Q, Q), tl.float32))
            chunk_cum += total
        decay = tl.where(causal, tl.exp(cum[:, None] - cum[None, :]), 0.0) * dt[None, :]
        y = tl.dot((scores * decay).to(x.dtype), x, input_precision=input_precision)  # within the chunk
        y += tl.dot(Cq, tl.trans(S.to(Cq.dtype)), input_precision=input_precision) * tl.exp(cum)[:, None]  # from before
        if HAS_D:
            y += tl.load(D_ptr + h).to(tl.float32) * x.to(tl.float32)
        tl.store(y_ptr + ((b * T + t[:, None]) * H + h) * P + offs_p[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=mt[:, None] & mp[None, :])
        weighted = x.to(tl.float32) * (dt * tl.exp(total - cum))[:, None]  # each token's input, decayed to the end
        S = S * tl.exp(total) + tl.dot(tl.trans(weighted.to(Bq.dtype)), Bq, input_precision=input_precision)
    tl.store(hT_ptr + state_at, S, mask=mp[:, None] & mn[None, :])


def chunk_scan_forward(x, dt, A, B, C, D=None, chunk_size: int = 64, initial_state=None):
    """`naive_chunk_scan`'s outputs without its autograd: y (B, T, H, P) in x's dtype and the final
    state (B, H, P, S) in fp32. x, B, C with unit stride in their last dim (any other strides);
    chunk_size is accepted for the contract and not used (see the module's docstring)."""
    y, final, _ = _launch(x, dt, A, B, C, D, initial_state, keep_chunk=None)
    return y, final


def keeping_chunk(chunk_size: int, dtype: torch.dtype) -> bool:
    """Whether `chunk_scan_forward_keeping` serves chunks of chunk_size (a multiple of its tile's tokens)."""
    Q = (FP32_TILE if dtype == torch.float32 else TILE)[0]
    return chunk_size >= Q and chunk_size % Q == 0


def chunk_scan_forward_keeping(x, dt, A, B, C, D, chunk_size: int):
    """The training forward from zero state: y, the final state, and what mamba_ssm's SSD backward
    reads, for chunks of chunk_size (`keeping_chunk`): the log-decays cumulated within each chunk
    and dt (B, H, chunks, chunk_size) fp32, the state entering each chunk (B, chunks, H, P, S) fp32,
    and C B^T within each chunk (B, chunks, G, chunk_size, chunk_size) fp32 (above the diagonal
    blocks: zeros; the backward reads its lower triangle)."""
    y, final, kept = _launch(x, dt, A, B, C, D, None, keep_chunk=chunk_size)
    return y, final, *kept


def _launch(x, dt, A, B, C, D, initial_state, keep_chunk):
    batch, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    if H % G or C.shape != B.shape or dt.shape != (batch, T, H) or A.shape != (H,):
        raise ValueError(f"chunk_scan_forward: x {tuple(x.shape)} dt {tuple(dt.shape)} A {tuple(A.shape)} "
                         f"B {tuple(B.shape)} C {tuple(C.shape)} do not match")
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    y = torch.empty(batch, T, H, P, device=x.device, dtype=x.dtype)
    final = torch.empty(batch, H, P, N, device=x.device, dtype=torch.float32)
    h0 = initial_state.float().contiguous() if initial_state is not None else final
    Q, bp, warps, stages = FP32_TILE if x.dtype == torch.float32 else TILE
    bp = min(bp, max(16, triton.next_power_of_2(P)))
    if keep_chunk is not None:
        if not keeping_chunk(keep_chunk, x.dtype):
            raise ValueError(f"chunk_scan_forward_keeping: chunks of {keep_chunk} are not a multiple of {Q}")
        chunks = -(-T // keep_chunk)
        f32 = dict(device=x.device, dtype=torch.float32)
        kept = [torch.empty(batch, H, chunks, keep_chunk, **f32), torch.empty(batch, H, chunks, keep_chunk, **f32),
                torch.empty(batch, chunks, H, P, N, **f32), torch.empty(batch, chunks, G, keep_chunk, keep_chunk, **f32)]
        end, subs = chunks * keep_chunk, keep_chunk // Q
    else:
        kept, chunks, end, subs = [final] * 4, 1, T, 1
    _ssd_forward_kernel[(batch * H, triton.cdiv(P, bp))](
        x, dt, A, B, C, D if D is not None else A, h0, y, final, *kept,
        T, end, chunks, H, P, N, H // G,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), dt.stride(2),
        B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
        HAS_D=D is not None, HAS_H0=initial_state is not None, IEEE=x.dtype == torch.float32,
        KEEP=keep_chunk is not None, SUBS=subs,
        Q=Q, BP=bp, BN=max(16, triton.next_power_of_2(N)), STAGES=stages, num_warps=warps,
    )
    return y, final, kept
