"""The last step of the chunked SSD scan's backward: the decay gradients to dt's and A's, in one launch.

The scan's decays are dA = dt * A per token, and cumsums of them within each chunk. Its backward
(mamba_ssm's kernels, training/scan.py) leaves the gradient of the loss towards them in four pieces,
each (batch, heads, chunks, chunk) fp32 unless said:

- `within`: towards each token's dA, from the products inside its chunk;
- `from_states`: towards each token's dA, from the chunk's state leaving it;
- `from_outputs`: towards each token's *cumulative* decay, from the outputs of the state carried in;
- `chunk_ends`: (batch, heads, chunks), towards each chunk's total decay, from the state passing.

A gradient towards a cumulative decay reaches every token at or before it in the chunk (a reverse
cumsum), and the chunk's total is its cumulative decay at the last slot. Then dt's gradient is
dA's times A plus `ddt_chunks` (dt's own, from the products), and A's is the sum of dA's times dt.
mamba_ssm does this as eight small launches a layer (an add into the last slot, flip, cumsum,
flip, two adds, its cumsum backward and that one's zeroing); `decay_grad` is one launch after a
zeroing of A's (heads,) gradient.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

HEADS_PER_PROGRAM = 8


def decay_grad_reference(within, from_outputs, from_states, chunk_ends, ddt_chunks, dt, A):
    """(ddt (batch, T, heads), dA (heads,)), both fp32, in plain torch: `decay_grad`'s spec.

    dt (batch, T, heads) is the scan's (processed) time step, A (heads,) its decay rates; the
    others as in the module's docstring. Slots past T in the last chunk take no part."""
    batch, T, heads = dt.shape
    chunks, size = within.shape[2], within.shape[3]
    to_cumulative = from_outputs.clone()
    to_cumulative[..., -1] += chunk_ends
    ddA = within + from_states + to_cumulative.flip(-1).cumsum(-1).flip(-1)
    ddt = ddA * A.float()[:, None, None] + ddt_chunks  # (batch, heads, chunks, size)
    ddt = ddt.permute(0, 2, 3, 1).reshape(batch, chunks * size, heads)[:, :T]
    dt_chunked = torch.nn.functional.pad(dt.float(), (0, 0, 0, chunks * size - T))  # zeros past T
    dt_chunked = dt_chunked.unflatten(1, (chunks, size)).permute(0, 3, 1, 2)
    return ddt.contiguous(), (ddA * dt_chunked).sum((0, 2, 3))


@triton.jit
def _decay_grad_kernel(within_ptr, outputs_ptr, states_ptr, ends_ptr, ddt_chunks_ptr, dt_ptr, A_ptr, ddt_ptr, dA_ptr,
                       T, H, NC, sdb, sdt, sgb, sgt,
                       Q: tl.constexpr, BH: tl.constexpr, BQ: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_h = tl.program_id(2) * BH + tl.arange(0, BH)
    offs_q = tl.arange(0, BQ)
    mh = offs_h < H
    row = (b * H + offs_h) * NC + c  # (BH,): the (batch, head, chunk) rows, each Q slots long
    at = row[:, None] * Q + offs_q[None, :]
    whole = mh[:, None] & (offs_q < Q)[None, :]
    to_cumulative = tl.load(outputs_ptr + at, mask=whole, other=0.0)
    ends = tl.load(ends_ptr + row, mask=mh, other=0.0)
    to_cumulative += tl.where(offs_q[None, :] == Q - 1, ends[:, None], 0.0)
    ddA = tl.cumsum(to_cumulative, axis=1, reverse=True)
    ddA += tl.load(within_ptr + at, mask=whole, other=0.0) + tl.load(states_ptr + at, mask=whole, other=0.0)
    t = c * Q + offs_q
    # Slots past Q (BQ > Q when the chunk is no power of two) hold the next chunk's times: written
    # here, they would race with that chunk's program.
    valid = whole & (t < T)[None, :]
    A = tl.load(A_ptr + offs_h, mask=mh, other=0.0).to(tl.float32)
    ddt = ddA * A[:, None] + tl.load(ddt_chunks_ptr + at, mask=valid, other=0.0)
    tl.store(ddt_ptr + b * sgb + t[None, :] * sgt + offs_h[:, None], ddt, mask=valid)
    dt = tl.load(dt_ptr + b * sdb + t[None, :] * sdt + offs_h[:, None], mask=valid, other=0.0).to(tl.float32)
    tl.atomic_add(dA_ptr + offs_h, tl.sum(tl.where(valid, ddA * dt, 0.0), axis=1), mask=mh)


def decay_grad(within, from_outputs, from_states, chunk_ends, ddt_chunks, dt, A):
    """`decay_grad_reference`'s (ddt, dA) in one Triton launch (and a zeroing of dA); dt's last
    dim of unit stride, the others contiguous fp32 (as mamba_ssm's backward kernels leave them)."""
    batch, T, heads = dt.shape
    chunks, size = within.shape[2], within.shape[3]
    rows = (batch, heads, chunks, size)
    for name, t in (("within", within), ("from_outputs", from_outputs), ("from_states", from_states),
                    ("ddt_chunks", ddt_chunks), ("chunk_ends", chunk_ends)):
        want = rows[:3] if name == "chunk_ends" else rows
        if tuple(t.shape) != want or t.dtype != torch.float32:
            raise ValueError(f"decay_grad: {name} is {tuple(t.shape)} {t.dtype}, expected {want} float32")
    if dt.stride(-1) != 1:
        dt = dt.contiguous()
    A = A.float().contiguous()
    within, from_outputs, from_states, chunk_ends, ddt_chunks = (
        t.contiguous() for t in (within, from_outputs, from_states, chunk_ends, ddt_chunks))
    ddt = torch.empty(batch, T, heads, device=dt.device, dtype=torch.float32)
    dA = torch.zeros(heads, device=dt.device, dtype=torch.float32)
    grid = (batch, chunks, triton.cdiv(heads, HEADS_PER_PROGRAM))
    _decay_grad_kernel[grid](within, from_outputs, from_states, chunk_ends, ddt_chunks, dt, A, ddt, dA,
                             T, heads, chunks, dt.stride(0), dt.stride(1), ddt.stride(0), ddt.stride(1),
                             Q=size, BH=HEADS_PER_PROGRAM, BQ=triton.next_power_of_2(size), num_warps=4)
    return ddt, dA
