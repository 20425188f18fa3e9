"""Probe: does a TMA (tensor-descriptor) skinny GEMM stream the weights faster than ours?

An experiment, not a library path. At 16 tree nodes the two projections of a mamba2-2.7b layer
take ~36 us for 27.7 us of weights at the copy rate (BENCHMARKS.md, round 4): the pointer-based
skinny GEMM (`ops/gemv/triton.skinny_linear`) streams at 2.0-2.6 TB/s. This times, at the
2.7b shapes and M rows, in one process and on rotating weight copies:

- `ours`: skinny_linear with its tuned config;
- `cuBLAS`: F.linear;
- `tma`: W tiles through a host tensor descriptor (the copy engine, mbarrier pipeline), rows
  x W^T as ours computes them;
- `tma-swap`: W (BLOCK_N x BK) @ x^T (BK x M), so the weight tile is the tensor-core A operand
  (wgmma takes 64-row A tiles; rows of x are its N), optionally split over K with fp32 partials
  summed afterwards (the sum is inside the timed region).

Run on the GPU from the repository root: `python3 bench/skinny_probe.py [--rows 16,64]`.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph
from triton.tools.tensor_descriptor import TensorDescriptor

from ssmspec.ops.gemv.triton import skinny_linear

BF16 = torch.bfloat16


@triton.jit
def _probe_kernel(x_ptr, x_desc, w_ptr, w_desc, y_ptr, M, N, K, k_per_split, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
                  SWAP: tl.constexpr, SPLIT: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        if TMA:
            w = w_desc.load([n0, k0])
            x = x_desc.load([0, k0])
        else:
            w = tl.load(w_ptr + offs_n[:, None] * K + offs_k[None, :],
                        mask=(offs_n[:, None] < N) & (offs_k[None, :] < k_hi), other=0.0)
            x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :],
                        mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_hi), other=0.0)
        if SWAP:
            acc = tl.dot(w, tl.trans(x), acc)
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if SWAP:
        acc = tl.trans(acc)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    out = y_ptr + split * M * N + offs_m[:, None] * N + offs_n[None, :]
    if SPLIT > 1:
        tl.store(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


def probe_linear(x, w, cfg):
    """x (M, K) @ w (N, K)^T with one probe config (tma, swap, block_n, block_k, stages, warps, split)."""
    tma, swap, block_n, block_k, stages, warps, split = cfg
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    y = torch.empty((split, m, n), device=x.device, dtype=torch.float32 if split > 1 else x.dtype)
    w_desc = TensorDescriptor.from_tensor(w, [block_n, block_k]) if tma else None
    x_desc = TensorDescriptor(x, [m, k], [k, 1], [block_m, block_k]) if tma else None
    _probe_kernel[(triton.cdiv(n, block_n), split)](
        x, x_desc, w, w_desc, y, m, n, k, k_per_split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        STAGES=stages, TMA=tma, SWAP=swap, SPLIT=split, num_warps=warps)
    return y[0] if split == 1 else y.sum(0).to(x.dtype)


def time_us(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return 1000 * do_bench_cudagraph(fn, rep=50, return_mode="median")


CONFIGS = [
    # (tma, swap, block_n, block_k, stages, warps, split)
    (False, False, 16, 128, 5, 2, 1),
    (True, False, 16, 128, 5, 2, 1),
    (True, False, 16, 256, 4, 2, 1),
    (True, False, 16, 256, 6, 4, 1),
    (True, False, 32, 128, 6, 4, 1),
    (True, False, 32, 256, 4, 4, 1),
    (True, False, 64, 128, 4, 4, 1),
    (True, True, 64, 128, 4, 4, 1),
    (True, True, 64, 256, 3, 4, 1),
    (True, True, 64, 128, 6, 4, 1),
    (True, True, 64, 128, 4, 4, 2),
    (True, True, 64, 128, 4, 4, 3),
    (True, True, 128, 128, 4, 4, 1),
    (True, True, 128, 128, 4, 8, 2),
    (False, True, 64, 128, 4, 4, 1),
]

SHAPES = {"in_proj": (10576, 2560), "out_proj": (2560, 5120), "lm_head": (50288, 2560)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,64", help="comma-separated row counts (default 16,64)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {sorted(SHAPES)}")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skinny_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    summary = []
    for label in args.shapes.split(","):
        n, k = SHAPES[label]
        nbytes = n * k * 2
        copies = max(2, math.ceil(200e6 / nbytes))
        wts = [torch.randn(n, k, device=dev, dtype=BF16) for _ in range(copies)]
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=BF16)
            ref = torch.nn.functional.linear(x.float(), wts[0].float())
            cub = time_us(lambda x=x, wts=wts: [torch.nn.functional.linear(x, w_) for w_ in wts]) / copies
            ours = time_us(lambda x=x, wts=wts: [skinny_linear(x, w_) for w_ in wts]) / copies
            rows = []
            for cfg in CONFIGS:
                try:
                    got = probe_linear(x, wts[0], cfg).float()
                    err = ((got - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        print(f"  {label} M={m} {cfg}: WRONG rel err {err:.2e}", flush=True)
                        continue
                    rows.append((cfg, time_us(lambda cfg=cfg, x=x, wts=wts: [probe_linear(x, w_, cfg) for w_ in wts]) / copies))
                except Exception as e:  # noqa: BLE001 -- a config the compiler or TMA rejects
                    print(f"  {label} M={m} {cfg}: failed {e!r}"[:240], flush=True)
            rows.sort(key=lambda r: r[1])
            print(f"{label} M={m}: cuBLAS {cub:.2f} us, ours {ours:.2f} us ({nbytes / ours / 1e6:.2f} TB/s)", flush=True)
            for cfg, us in rows:
                print(f"    {cfg!s:<42} {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s  x ours {us / ours:5.2f}")
            if rows:
                summary.append((label, m, cub, ours, rows[0]))
        del wts
    print(f"\n{'shape':<10} {'M':>3} {'cuBLAS':>8} {'ours':>8} {'best probe':>10}  config")
    for label, m, cub, ours, (cfg, us) in summary:
        print(f"{label:<10} {m:>3} {cub:8.2f} {ours:8.2f} {us:10.2f}  {cfg}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
