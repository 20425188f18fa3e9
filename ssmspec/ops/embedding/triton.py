"""Triton kernel of the embedding lookup with its rows' sums of squares; `naive.py` is the spec.

At 16 rows (a 16-node verify) torch's index_select takes its few-index kernel, 12.8 us on the
H100 against 2 us for its gather at 64 rows (BENCHMARKS.md, round 9). Here one program copies one
block of one row and writes the block's sum of squares, so the first sublayer's norm needs no
launch of its own (ops/gemv `norm_linear` x_sq).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..pdl import gdc_launch_dependents, gdc_wait
from ..step_update.triton import _pdl_args

BLOCK_D = 512


@triton.jit
def _embed_kernel(w_ptr, tok_ptr, h_ptr, sq_ptr, D, swv, shr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    tok = tl.load(tok_ptr + row)
    v = tl.load(w_ptr + tok * swv + offs, mask=mask, other=0.0)
    tl.store(h_ptr + row * shr + offs, v, mask=mask)
    vf = v.to(tl.float32)
    tl.store(sq_ptr + row * tl.num_programs(1) + part, tl.sum(vf * vf, axis=0))


def embed(weight: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight[tokens] and its rows' partial sums of squares; same contract as `naive_embed`
    (parts = ceil(D / BLOCK_D) here)."""
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"embed: weight must be a (V, D) table with contiguous rows, got {tuple(weight.shape)}")
    vocab, dim = weight.shape
    flat = tokens.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    rows = flat.numel()
    h = torch.empty(rows, dim, device=weight.device, dtype=weight.dtype)
    parts = triton.cdiv(dim, BLOCK_D)
    sq = torch.empty(rows, 1, parts, device=weight.device, dtype=torch.float32)
    if rows:
        _embed_kernel[(rows, parts)](weight, flat, h, sq, dim, weight.stride(0), h.stride(0), BLOCK=BLOCK_D,
                                     num_warps=4, **_pdl_args(weight.device))
    return h.reshape(*tokens.shape, dim), sq
