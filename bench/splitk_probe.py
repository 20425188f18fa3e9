"""Probe: the skinny GEMM with K split over several programs per tile, alone, at the verify's shapes.

At 16 tree nodes the mamba2-2.7b out_proj has 80 tiles of 32 columns for 132 SMs and streams at
~2 TB/s; the in_proj's 166 tiles leave 34 SMs with two. A config's eighth entry splits each
tile's K over that many programs (ops/gemv/triton `_skinny_kernel`, SPLIT). This times
`skinny_linear` as the verify calls it (norm from the producer's parts; out_proj with the residual
and its own parts out) on rotating weight copies (no L2 reuse), one launch after another in a
CUDA graph, for the given configs. Rankings inside the tree iteration come from
`tune_skinny_graph.py --out-candidates ... --in-candidates ...`.

Run on the GPU from the repository root:

    python3 bench/splitk_probe.py [--rows 16] [--out "32,256,2,4,0,1,2;32,256,2,4,0,1,2,2"] [--in "..."]
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
from triton.testing import do_bench_cudagraph

from ssmspec.ops.gemv.triton import SKINNY_TUNED, skinny_linear

OUT = "32,256,2,4,0,1,2;32,256,2,4,0,1,2,2;32,256,2,4,0,1,2,3;16,256,2,4,0,1,2,2;64,256,4,4,0,1,2,3;64,128,4,4,0,2,3,3"
IN = "64,128,4,4,0,2,3;64,128,4,4,0,2,3,2;128,128,4,4,0,2,3,2;128,128,4,4,0,2,3,3;64,128,4,3,0,2,3,2"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--out", default=OUT, help="';'-separated out_proj configs")
    ap.add_argument("--in", dest="in_", default=IN, help="';'-separated in_proj configs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("splitk_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    dev, m = torch.device("cuda"), args.rows
    print(torch.cuda.get_device_name(), "torch", torch.__version__, flush=True)
    for label, (n, k), specs, residual in (("out_proj", (2560, 5120), args.out, True),
                                           ("in_proj", (10576, 2560), args.in_, False)):
        nbytes = n * k * 2
        copies = max(2, math.ceil(400e6 / nbytes))
        wts = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) / 16 for _ in range(copies)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        x_sq = x.float().pow(2).sum(-1).reshape(m, 1, 1).contiguous()
        res = torch.randn(m, n, device=dev, dtype=torch.bfloat16) if residual else None

        def call(w, cfg):
            return skinny_linear(x, w, None, config=cfg, norm_groups=1, eps=1e-5, residual=res, x_sq=x_sq,
                                 return_sq=residual)

        print(f"{label} ({n}x{k}, {nbytes / 1e6:.1f} MB), {m} rows; table entry {SKINNY_TUNED.get((n, k))}", flush=True)
        ref = None
        for spec in specs.split(";"):
            cfg = tuple(int(v) for v in spec.split(","))
            try:
                got = call(wts[0], cfg)
                got = (got[0] if residual else got).float()
                ref = got if ref is None else ref
                err = ((got - ref).norm() / ref.norm()).item()
                us = do_bench_cudagraph(lambda cfg=cfg: [call(w, cfg) for w in wts], rep=200) * 1e3 / copies
                print(f"    {spec:<28} {us:7.2f} us  {nbytes / us / 1e6:5.2f} TB/s  rel diff to the first {err:.1e}",
                      flush=True)
            except Exception as e:  # noqa: BLE001 -- a config the compiler or the checks reject
                print(f"    {spec:<28} failed {e!r}"[:240], flush=True)
        del wts
    return 0


if __name__ == "__main__":
    sys.exit(main())
