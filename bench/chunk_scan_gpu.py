"""The training scans alone on a GPU: forward + backward time and peak memory of one Mamba-2 layer's chunked SSD.

naive_chunk_scan (the reference, a loop over chunks) and parallel_chunk_scan (every chunk at once)
at a mamba2-130m layer (24 heads of 64, d_state 128, one group, 16 x 512 tokens: `sft`'s batch) and
a mamba2-780m layer (48 heads, 2 x 2048), under bf16 autocast, for each chunk length given.
CUDA-event medians after warm-up. Run on a CUDA machine from the repository root, with ssmspec
installed:

    python bench/chunk_scan_gpu.py --chunks 64,128,256 --out chunk_scan_gpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

SHAPES = {  # name: (batch, tokens, heads, head dim, groups, d_state)
    "mamba2-130m layer, 16 x 512": (16, 512, 24, 64, 1, 128),
    "mamba2-780m layer, 2 x 2048": (2, 2048, 48, 64, 1, 128),
}


def inputs(batch, steps, heads, headdim, groups, dstate):
    """bf16 x, B, C (as the model hands them over under autocast), fp32 dt, A, D; all requiring grad."""
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    x = r(batch, steps, heads, headdim).bfloat16()
    dt = torch.nn.functional.softplus(r(batch, steps, heads) - 1.0).clamp(1e-3, 1.0)
    A, D = -torch.exp(r(heads) * 0.5), r(heads)
    B, C = (r(batch, steps, groups, dstate) * 0.5).bfloat16(), (r(batch, steps, groups, dstate) * 0.5).bfloat16()
    return [t.requires_grad_() for t in (x, dt, A, B, C, D)]


def time_scan(fn, args, chunk, iters):
    """Median ms of forward + backward (upstream gradients of ones), and peak memory in GB."""
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, final = fn(*args, chunk, None)
        (y.sum() + final.sum()).backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", default="64,128,256", help="Chunk lengths, comma-separated.")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-naive", action="store_true", help="Leave the reference out (it is the slow one).")
    ap.add_argument("--out", type=Path, default=None, help="Where the rows go as JSON.")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("chunk_scan_gpu.py needs a CUDA device")

    from ssmspec.ops.chunk_scan import naive_chunk_scan, parallel_chunk_scan

    scans = {"parallel": parallel_chunk_scan}
    if not args.skip_naive:
        scans = {"naive": naive_chunk_scan, **scans}
    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | chunk | scan | fwd+bwd ms | tokens/s (this layer) | peak GB |\n|---|---:|---|---:|---:|---:|")
    for shape_name, shape in SHAPES.items():
        args_ = inputs(*shape)
        tokens = shape[0] * shape[1]
        for chunk in (int(c) for c in args.chunks.split(",")):
            for scan_name, fn in scans.items():
                ms, peak = time_scan(fn, args_, chunk, args.iters)
                rows.append({"shape": shape_name, "chunk": chunk, "scan": scan_name, "ms": ms, "peak_gb": peak,
                             "tokens_per_s": tokens / ms * 1e3})
                print(f"| {shape_name} | {chunk} | {scan_name} | {ms:.2f} | {tokens / ms * 1e3:,.0f} | {peak:.2f} |",
                      flush=True)
                for t in args_:
                    t.grad = None
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
