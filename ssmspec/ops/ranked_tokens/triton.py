"""Triton kernel of `ranked_tokens`; `naive.py` is the spec.

A drafter level picks each new node's token as the r-th best of its parent's logits. In torch
that is a top-k (a radix select: ~25 us for a few rows of an 8k vocabulary on an H100/H200),
an index and an index_put: three launches and most of a small drafter's level. Here it is one
launch with one program per node: rank r takes r + 1 passes over its row, each the largest
value below the previous pick in (value descending, index ascending) order, so siblings reuse
nothing but each program finishes in a few microseconds (rows are L2-resident, r is small).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_common import NO_INDEX, argmax_pick, argmax_step, gdc_launch_dependents, gdc_wait, pdl_args
BLOCK_V = 4096
"""Vocabulary tile of one pass step (8 warps: 16 values per thread)."""


@triton.jit
def _ranked_tokens_kernel(
    logits_ptr, rows_ptr, ranks_ptr, out_ptr,
    V, slr, slv, sout,
    BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    i = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + i).to(tl.int64) * slr
    rank = tl.load(ranks_ptr + i).to(tl.int32)
    # The previous pick (value, index); before the first pass everything ranks below it.
    prev_v = tl.full([], float("inf"), tl.float32)
    prev_i = tl.full([], -1, tl.int32)
    for _ in range(0, rank + 1):
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)
        arg = tl.full([BLOCK_V], NO_INDEX, tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            v = tl.load(base + offs * slv, mask=offs < V, other=float("-inf")).to(tl.float32)
            below = (offs < V) & ((v < prev_v) | ((v == prev_v) & (offs > prev_i)))
            best, arg = argmax_step(v, offs, below, best, arg)  # -inf logits still rank, in index order
        prev_v, prev_i = argmax_pick(best, arg)
    tl.store(out_ptr + i * sout, prev_i.to(tl.int64))


def ranked_tokens(logits: torch.Tensor, rows: torch.Tensor, ranks: torch.Tensor,
                  out: torch.Tensor | None = None, *, block_v: int | None = None) -> torch.Tensor:
    """One launch of `naive_ranked_tokens` (same contract; `block_v`: a smaller tile for tests)."""
    if logits.dim() != 2 or logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"ranked_tokens: logits must be (R, V) fp32/bf16/fp16, got {tuple(logits.shape)} {logits.dtype}")
    if rows.shape != ranks.shape or rows.dim() != 1:
        raise ValueError(f"ranked_tokens: rows {tuple(rows.shape)} and ranks {tuple(ranks.shape)} must be one (W,) shape")
    width, vocab = rows.shape[0], logits.shape[1]
    if out is None:
        out = torch.empty(width, dtype=torch.long, device=logits.device)
    if width == 0:
        return out
    block_v = block_v or min(BLOCK_V, max(16, triton.next_power_of_2(vocab)))
    _ranked_tokens_kernel[(width,)](
        logits, rows, ranks, out,
        vocab, *logits.stride(), out.stride(0),
        BLOCK_V=block_v, num_warps=8 if block_v >= 4096 else 4, **pdl_args(logits.device),
    )
    return out


@triton.jit
def _race_tokens_kernel(
    probs_ptr, rows_ptr, noise_ptr, out_ptr,
    V, spr, snr, sout,
    BLOCK_V: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
    i = tl.program_id(0)
    base = probs_ptr + tl.load(rows_ptr + i).to(tl.int64) * spr
    noise = noise_ptr + i.to(tl.int64) * snr
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    arg = tl.full([BLOCK_V], NO_INDEX, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        s = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(noise + offs, mask=mask, other=1.0)
        best, arg = argmax_step(s, offs, mask, best, arg)
    _, pick = argmax_pick(best, arg)
    tl.store(out_ptr + i * sout, pick.to(tl.int64))


def race_tokens(probs: torch.Tensor, rows: torch.Tensor, noise: torch.Tensor,
                out: torch.Tensor | None = None, *, block_v: int | None = None) -> torch.Tensor:
    """One launch of `naive_race_tokens` (same contract): the row gather, the division and the
    argmax of the torch version (four launches with the copy into `out`) in one pass per child."""
    if probs.dim() != 2 or probs.stride(1) != 1 or noise.dim() != 2 or noise.stride(1) != 1:
        raise ValueError(f"race_tokens: probs (R, V) and noise (W, V) need a unit last stride, "
                         f"got {tuple(probs.shape)} and {tuple(noise.shape)}")
    if noise.dtype != torch.float32 or noise.shape != (rows.shape[0], probs.shape[1]):
        raise ValueError(f"race_tokens: noise must be ({rows.shape[0]}, {probs.shape[1]}) fp32, got "
                         f"{tuple(noise.shape)} {noise.dtype}")
    width, vocab = rows.shape[0], probs.shape[1]
    if out is None:
        out = torch.empty(width, dtype=torch.long, device=probs.device)
    if width == 0:
        return out
    block_v = block_v or min(BLOCK_V, max(16, triton.next_power_of_2(vocab)))
    _race_tokens_kernel[(width,)](
        probs, rows, noise, out,
        vocab, probs.stride(0), noise.stride(0), out.stride(0),
        BLOCK_V=block_v, num_warps=8 if block_v >= 4096 else 4, **pdl_args(probs.device),
    )
    return out
