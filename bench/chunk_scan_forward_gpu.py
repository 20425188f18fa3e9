"""The inference scan on a GPU: one Mamba-2 layer's chunked SSD forward without autograd.

ssmspec's forward kernel (`ops/chunk_scan/triton.py:chunk_scan_forward`, what a distillation target
and evaluation run; and `chunk_scan_forward_keeping`, the training forward that also writes what
mamba_ssm's backward reads) against mamba_ssm's forward (`_mamba_chunk_scan_combined_fwd`, chunks of 128)
where its sources import, and the plain-torch reference (eager), at the mamba2-130m layer (16 x 512, and
32 x 512: a distillation target's batch), the 1.3b layer (64 heads) and the 2.7b one (80 heads,
8 x 2048): bf16 x, B, C, fp32 dt. Medians of CUDA-graph replays (triton.testing); the
largest difference of y against mamba_ssm's is printed beside. From the repository root, with
ssmspec installed (and mamba_ssm's sources on PYTHONPATH for its column):

    python bench/chunk_scan_forward_gpu.py --out chunk_scan_forward_gpu.json
"""
from __future__ import annotations

import torch

from _one_layer import parse_args, replayed, write_rows  # bench/ is the script's directory: on sys.path

SHAPES = {  # name: (batch, tokens, heads); head dim 64, d_state 128, one group
    "130m, 16 x 512": (16, 512, 24),
    "130m, 32 x 512": (32, 512, 24),
    "1.3b, 16 x 512": (16, 512, 64),
    "2.7b, 8 x 2048": (8, 2048, 80),
}


def inputs(batch, steps, heads):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, device="cuda", generator=g)  # noqa: E731
    x = r(batch, steps, heads, 64).bfloat16()
    dt = torch.nn.functional.softplus(r(batch, steps, heads) - 2.0)
    A = -torch.exp(0.5 * r(heads))
    B, C = (0.3 * r(batch, steps, 1, 128)).bfloat16(), (0.3 * r(batch, steps, 1, 128)).bfloat16()
    return x, dt, A, B, C, r(heads)


def main() -> None:
    args = parse_args(__doc__, "chunk_scan_forward_gpu.py")

    from triton.testing import do_bench

    from ssmspec.ops.chunk_scan.naive import naive_chunk_scan
    from ssmspec.ops.chunk_scan.triton import chunk_scan_forward, chunk_scan_forward_keeping
    from ssmspec.training.scan import _import_mamba_ssd

    mamba = _import_mamba_ssd()
    mamba_fwd = mamba.__globals__["_mamba_chunk_scan_combined_fwd"] if mamba else None
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; mamba_ssm {'imports' if mamba else 'absent'}")
    print("| layer | ours ms | ours, keeping ms | mamba_ssm ms | plain torch ms | max abs diff of y vs mamba_ssm |")
    print("|---|---:|---:|---:|---:|---:|")

    rows = []
    with torch.no_grad():
        for name, shape in SHAPES.items():
            x, dt, A, B, C, D = inputs(*shape)
            ours = replayed(lambda: chunk_scan_forward(x, dt, A, B, C, D, 128), args.rep_ms)
            keeping = replayed(lambda: chunk_scan_forward_keeping(x, dt, A, B, C, D, 128), args.rep_ms)
            theirs = replayed(lambda: mamba_fwd(x, dt, A, B, C, 128, D=D), args.rep_ms) if mamba_fwd else float("nan")
            plain = do_bench(lambda: naive_chunk_scan(x, dt, A, B, C, D, 128), rep=args.rep_ms, return_mode="median")
            diff = float("nan")
            if mamba_fwd:
                diff = (chunk_scan_forward(x, dt, A, B, C, D, 128)[0].float()
                        - mamba_fwd(x, dt, A, B, C, 128, D=D)[0].float()).abs().max().item()
            rows.append({"layer": name, "ours_ms": ours, "keeping_ms": keeping, "mamba_ssm_ms": theirs,
                         "plain_ms": plain, "max_diff": diff})
            print(f"| {name} | {ours:.4f} | {keeping:.4f} | {theirs:.4f} | {plain:.3f} | {diff:.3e} |", flush=True)
    write_rows(args.out, rows)


if __name__ == "__main__":
    main()
