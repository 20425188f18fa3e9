"""Probe: does the skinny GEMM's weight box shape limit its stream (DRAM locality)?

At 16 rows the product's skinny GEMM reads the mamba2-2.7b in_proj through 64 x 128 TMA boxes:
64 weight rows, 256 contiguous bytes of each, the next box 256 bytes further along each row. It
streams at ~2.4 TB/s (out_proj, 32 x 256 boxes: ~1.9-2.0), while the one-row GEMV, which reads
whole rows, reaches ~2.9. This times one minimal kernel (TMA boxes, W x^T on the tensor cores, no
norm or epilogue) over a 3-D view of the same row-major weight, (N, K / KB, KB), with boxes of
(rows, chunks, KB): each weight row contributes chunks x KB contiguous elements per box. chunks 1
is the product's box shape; more chunks read longer contiguous runs per row. Rotating weight
copies (no L2 reuse), launches back to back in a CUDA graph.

Run on the GPU from the repository root: `python3 bench/box_shape_probe.py`.
"""
from __future__ import annotations

import math
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph
from triton.tools.tensor_descriptor import TensorDescriptor

from ssmspec.ops.gemv.triton import SKINNY_TUNED, skinny_linear


@triton.jit
def _box_kernel(x_ptr, w_desc, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                CHUNKS: tl.constexpr, KB: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for c0 in range(0, K // KB, CHUNKS):
        w = w_desc.load([n0, c0, 0]).reshape(BLOCK_N, CHUNKS * KB)
        offs_k = c0 * KB + tl.arange(0, CHUNKS * KB)
        xt = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m < M)[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(xt), acc)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(y_ptr + offs_m[None, :] * N + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=(offs_n < N)[:, None] & (offs_m < M)[None, :])


def box_linear(x, w, block_n, chunks, kb, warps, stages, desc=None):
    m, k = x.shape
    n = w.shape[0]
    desc = desc or TensorDescriptor(w, [n, k // kb, kb], [k, kb, 1], [block_n, chunks, kb])
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _box_kernel[(triton.cdiv(n, block_n),)](x, desc, y, m, n, k, BLOCK_M=max(16, triton.next_power_of_2(m)),
                                            BLOCK_N=block_n, CHUNKS=chunks, KB=kb, num_warps=warps,
                                            num_stages=stages)
    return y


# (rows, chunks, KB, warps, stages)
CONFIGS = [(64, 1, 128, 4, 4), (64, 2, 128, 4, 4), (64, 1, 256, 4, 4), (32, 2, 256, 4, 4), (32, 4, 128, 4, 4),
           (16, 4, 256, 4, 4), (16, 2, 256, 4, 6), (16, 8, 128, 4, 3), (32, 1, 256, 2, 4), (16, 2, 256, 2, 4),
           (16, 4, 256, 2, 3), (64, 2, 256, 4, 3)]


def main() -> int:
    if not torch.cuda.is_available():
        print("box_shape_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, m = torch.device("cuda"), 16
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    for label, (n, k) in (("in_proj", (10576, 2560)), ("out_proj", (2560, 5120))):
        nbytes = n * k * 2
        copies = max(2, math.ceil(400e6 / nbytes))
        wts = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 16 for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), wts[0].float())
        prod = do_bench_cudagraph(lambda: [skinny_linear(x, w) for w in wts], rep=200) * 1e3 / copies
        print(f"{label} ({n}x{k}, {nbytes / 1e6:.1f} MB), {m} rows: product skinny_linear {SKINNY_TUNED.get((n, k))} "
              f"{prod:.2f} us = {nbytes / prod / 1e6:.2f} TB/s", flush=True)
        for cfg in CONFIGS:
            bn, chunks, kb, warps, stages = cfg
            try:
                descs = [TensorDescriptor(w, [n, k // kb, kb], [k, kb, 1], [bn, chunks, kb]) for w in wts]
                got = box_linear(x, wts[0], *cfg, desc=descs[0]).float()
                err = ((got - ref).norm() / ref.norm()).item()
                us = do_bench_cudagraph(lambda: [box_linear(x, w, *cfg, desc=d) for w, d in zip(wts, descs)],
                                        rep=200) * 1e3 / copies
                print(f"    rows {bn:3d} x {chunks} x {kb} ({chunks * kb * 2:5d} B a row), {warps} warps, {stages} stages: "
                      f"{us:7.2f} us = {nbytes / us / 1e6:.2f} TB/s  (rel err {err:.1e})", flush=True)
            except Exception as e:  # noqa: BLE001 -- a config the compiler rejects
                print(f"    {cfg}: failed {e!r}"[:240], flush=True)
        del wts
    return 0


if __name__ == "__main__":
    sys.exit(main())
