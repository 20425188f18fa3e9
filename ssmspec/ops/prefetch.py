"""L2 prefetch of a tensor that a later kernel reads, issued by a kernel that waits on latency.

A kernel given a tensor to prefetch splits its 128-byte lines over its programs, and each program
issues `prefetch.global.L2` for its share before its PDL wait (ops/pdl.py). Only for tensors no
kernel in between writes. The prefetch is a hint with no effect on results; it is compiled only
for CUDA devices (Triton's interpreter has no inline assembly).

Measured (BENCHMARKS.md, round 7): prefetching the next projection's weights this way cost more
than it saved (run 75); the tree conv prefetching the SSM state that the tree scan reads next is
the use kept here.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LINE_BYTES = 128
_LINE_BYTES = tl.constexpr(LINE_BYTES)
_LINES_PER_ISSUE = tl.constexpr(128)


def available(t: torch.Tensor | None) -> bool:
    """Whether kernels may prefetch t: a CUDA tensor, not under the interpreter."""
    return t is not None and t.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def lines(t: torch.Tensor) -> int:
    """t's storage in whole 128-byte lines (t contiguous)."""
    return t.numel() * t.element_size() // LINE_BYTES


@triton.jit
def _prefetch_lines(ptrs, live):
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, live.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_share(base_ptr, n_lines, part, parts):
    """Prefetch program `part` of `parts`'s share of the first n_lines 128-byte lines at base_ptr into L2."""
    per_line: tl.constexpr = _LINE_BYTES * 8 // base_ptr.dtype.element_ty.primitive_bitwidth
    share = tl.cdiv(n_lines, parts)
    lo = part * share
    hi = tl.minimum(lo + share, n_lines)
    for l0 in range(lo, hi, _LINES_PER_ISSUE):
        offs = l0 + tl.arange(0, _LINES_PER_ISSUE)
        _prefetch_lines(base_ptr + offs.to(tl.int64) * per_line, offs < hi)
