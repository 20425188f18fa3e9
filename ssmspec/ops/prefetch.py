"""L2 prefetch of weights a later kernel will stream, issued by a latency-bound kernel.

At batch 1 the GPU's memory bus idles whenever a latency-bound kernel runs (the fused step
kernel of the decode step, the tree conv and the tree scan of a verify): a few microseconds per
layer in which no weight is read. A kernel given a prefetch range splits it over its programs,
and each program issues `prefetch.global.L2` for its share of 128-byte lines as its first
instructions, before its PDL wait (ops/pdl.py): the range is weights, which no kernel writes.
The projection that runs next then finds part of its weights in L2.

What a kernel prefetches is a byte range of a named target weight (PLAN); the model code names
the targets around each layer (`targets`). The prefetch is a hint with no effect on results; it
is off in the Triton interpreter (no inline assembly there) and on other devices.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

LINE_BYTES = 128
_LINE_BYTES = tl.constexpr(LINE_BYTES)
_LINES_PER_ISSUE = tl.constexpr(128)
"""Lines one program prefetches per loop iteration: one per thread at 4 warps."""

PLAN: dict[str, tuple[str, int, int]] = {}
"""kernel kind -> (target, first byte, number of bytes). Kinds: "step" and "step_out" (the decode
step's fused step kernel and its out_proj kernel), "tree_conv" and "tree_scan" (a verify's).
Targets, set by the model code around a layer with `targets`: "out_proj" (the layer's own
output projection) and "next" (the next layer's input projection, or the LM head). Empty: no
prefetch (benchmarks set entries while the gains are measured)."""

EVICT_LAST = False
"""Prefetch with the L2 evict-last priority (kept over the evict-first weight stream)."""

_targets: dict[str, torch.Tensor] = {}


@contextlib.contextmanager
def targets(**weights: torch.Tensor | None):
    """Name the weights the kernels launched inside may prefetch (see PLAN); a hint only."""
    global _targets
    saved = _targets
    _targets = {**saved, **{k: v for k, v in weights.items() if v is not None}}
    try:
        yield
    finally:
        _targets = saved


def enabled(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1" \
        and torch.cuda.get_device_capability(device)[0] >= 8


def kernel_args(kind: str) -> dict:
    """Keyword arguments (pf_ptr, pf_first, pf_lines, PREFETCH, PF_EVICT_LAST) for a kernel of
    `kind`: its planned range of its target weight, clipped to the weight; {} for none."""
    if kind not in PLAN:
        return {}
    target, first, nbytes = PLAN[kind]
    weight = _targets.get(target)
    if weight is None or not enabled(weight.device):
        return {}
    total = weight.numel() * weight.element_size()
    first = min(first, total)
    lines = min(nbytes, total - first) // LINE_BYTES
    if lines == 0:
        return {}
    return {"pf_ptr": weight, "pf_first": first // LINE_BYTES, "pf_lines": lines, "PREFETCH": True,
            "PF_EVICT_LAST": EVICT_LAST}


@triton.jit
def _prefetch_lines(ptrs, live, EVICT_LAST: tl.constexpr):
    if EVICT_LAST:
        asm: tl.constexpr = ("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; "
                             "mov.u32 $0, 0; }")
    else:
        asm: tl.constexpr = "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }"
    return tl.inline_asm_elementwise(asm, "=r,l,r", [ptrs, live.to(tl.int32)], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def prefetch_share(base_ptr, first_line, n_lines, part, parts, EVICT_LAST: tl.constexpr):
    """Prefetch program `part` of `parts`'s share of lines [first_line, first_line + n_lines) of
    the tensor at base_ptr into L2."""
    per_line: tl.constexpr = _LINE_BYTES * 8 // base_ptr.dtype.element_ty.primitive_bitwidth
    share = tl.cdiv(n_lines, parts)
    lo = part * share
    hi = tl.minimum(lo + share, n_lines)
    for l0 in range(lo, hi, _LINES_PER_ISSUE):
        offs = l0 + tl.arange(0, _LINES_PER_ISSUE)
        _prefetch_lines(base_ptr + (first_line + offs).to(tl.int64) * per_line, offs < hi, EVICT_LAST)
