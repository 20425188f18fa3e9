"""Triton helpers that several ops share: the PDL launch arguments and wait/launch primitives
(ops/pdl.py), softplus, a vocabulary-wide argmax with torch's tie rule, and the one-launch RMSNorm (step_update's norms and gemv's norm-then-cuBLAS
route both run it). Every op's `triton.py` imports these from here, never from another op.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import pdl
from .pdl import gdc_launch_dependents, gdc_wait

__all__ = ["NO_INDEX", "argmax_pick", "argmax_step", "gdc_launch_dependents", "gdc_wait", "pdl_args", "rms_norm",
           "softplus"]


def pdl_args(device: torch.device) -> dict:
    """Launch arguments for programmatic dependent launch (ops/pdl.py) on devices that have it,
    none elsewhere: the kernel's USE_PDL constexpr and Triton's launch_pdl."""
    if not pdl.enabled(device):
        return {}
    return {"USE_PDL": True, "launch_pdl": True}


NO_INDEX = tl.constexpr(2**31 - 1)
"""An argmax lane's "no index yet": larger than every vocabulary index."""


@triton.jit
def argmax_step(v, offs, eligible, best, arg):
    """One tile of a per-lane running argmax over a row (best values, their indices): a lane takes
    an eligible value strictly above its best, or its first eligible one (so -inf values still
    rank); strictly above keeps the earlier index among equals."""
    take = eligible & ((v > best) | (arg == NO_INDEX))
    return tl.where(take, v, best), tl.where(take, offs, arg)


@triton.jit
def argmax_pick(best, arg):
    """The row's (max, first index holding it) from argmax_step's lanes: torch.argmax's choice."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where((best == top) & (arg != NO_INDEX), arg, NO_INDEX), axis=0)


@triton.jit
def softplus(x):
    # torch's softplus with its default threshold 20 (linear above it).
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, eps, sxr, sor, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
                     HAS_W: tl.constexpr = True):
    if USE_PDL:  # ops/pdl.py: the next kernel may launch now; wait for the previous before any access
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * sxr + offs, mask=offs < D, other=0.0).to(tl.float32)
        sq += v * v
    r = tl.rsqrt(tl.sum(sq, axis=0) / D + eps)
    for start in range(0, D, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < D
        v = tl.load(x_ptr + row * sxr + offs, mask=m, other=0.0).to(tl.float32) * r
        if HAS_W:
            v *= tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * sor + offs, v.to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(h: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in one launch (inference only: no backward). h (..., D) -> (..., D).
    weight None: no weight (folded into the next projection)."""
    dim = h.shape[-1]
    rows = h.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, device=h.device, dtype=h.dtype)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight if weight is not None else rows, out, dim, float(eps), rows.stride(0), out.stride(0),
            BLOCK=min(4096, triton.next_power_of_2(dim)), num_warps=8, HAS_W=weight is not None, **pdl_args(h.device),
        )
    return out.reshape(h.shape)


