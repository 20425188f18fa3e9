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
    T, H, P, N, heads_per_group,
    sxb, sxt, sxh, sdb, sdt, sdh, sBb, sBt, sBg, sCb, sCt, sCg,
    HAS_D: tl.constexpr, HAS_H0: tl.constexpr, IEEE: tl.constexpr,
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
    for start in tl.range(0, T, Q, num_stages=STAGES):
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
    _ssd_forward_kernel[(batch * H, triton.cdiv(P, bp))](
        x, dt, A, B, C, D if D is not None else A, h0, y, final,
        T, H, P, N, H // G,
        x.stride(0), x.stride(1), x.stride(2), dt.stride(0), dt.stride(1), dt.stride(2),
        B.stride(0), B.stride(1), B.stride(2), C.stride(0), C.stride(1), C.stride(2),
        HAS_D=D is not None, HAS_H0=initial_state is not None, IEEE=x.dtype == torch.float32,
        Q=Q, BP=bp, BN=max(16, triton.next_power_of_2(N)), STAGES=stages, num_warps=warps,
    )
    return y, final
