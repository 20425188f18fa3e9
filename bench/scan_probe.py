"""Probe: the gated tree scan alone at the mamba2-2.7b shape, by tree shape and knob.

Times `tree_scan_gated` (bf16 activations, fp32 state, CUDA-graph median) for trees of 16 and
64 nodes and a flat 64-node tree (depth 1: the shortest parent walk), over the knob settings in
SETTINGS ({"SCAN_BLOCK_S": 128}: the state in one chunk, straight-line code). Runs 49-50 also
timed a parent walk by register gathers and node blocks per program (in git history): no gain.
Run on the GPU from the repository root: `python3 bench/scan_probe.py`.
"""
from __future__ import annotations

import sys

import torch
from triton.testing import do_bench_cudagraph

from ssmspec.ops.tree_scan import triton as scan
from ssmspec.trees import Tree

H, P, S, BF16 = 80, 64, 128, torch.bfloat16


def inputs(n: int):
    dev = "cuda"
    x = torch.randn(1, n, H, P, device=dev, dtype=BF16)
    dt_raw = torch.randn(1, n, H, device=dev, dtype=BF16)
    dt_bias, A, D = torch.rand(H, device=dev), -torch.rand(H, device=dev) - 0.5, torch.randn(H, device=dev)
    B, C = torch.randn(1, n, 1, S, device=dev, dtype=BF16), torch.randn(1, n, 1, S, device=dev, dtype=BF16)
    z = torch.randn(1, n, H * P, device=dev, dtype=BF16)
    h0 = torch.randn(1, H, P, S, device=dev)
    return x, dt_raw, dt_bias, 0.0, float("inf"), A, B, C, D, z, h0


SETTINGS = [{}, {"SCAN_BLOCK_S": 128}, {"SCAN_BLOCK_S": 32}, {"SCAN_WARPS": 4}, {"SCAN_WARPS": 16},
            {"SCAN_BLOCK_P": 32, "SCAN_WARPS": 4}, {"SCAN_BLOCK_P": 32, "SCAN_WARPS": 4, "SCAN_BLOCK_S": 128}]
"""ops/tree_scan/triton knob settings to time ({}: the defaults)."""
DEFAULTS = {name: getattr(scan, name) for setting in SETTINGS for name in setting}


def main() -> int:
    if not torch.cuda.is_available():
        print("scan_probe needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = []
    for label, config in (("16 nodes (3,2,1)", (3, 2, 1)), ("64 nodes (3,4,2,1)", (3, 4, 2, 1)), ("64 flat (63)", (63,))):
        tree = Tree.from_config(config)
        x, dt_raw, dt_bias, lo, hi, A, B, C, D, z, h0 = inputs(tree.num_nodes)
        parents = tree.parents_tensor("cuda")
        ref = None
        for setting in SETTINGS:
            for name, value in {**DEFAULTS, **setting}.items():
                setattr(scan, name, value)

            def call():
                return scan.tree_scan_gated(x, dt_raw, dt_bias, lo, hi, A, B, C, D, z, parents, h0, return_sq=True)

            g = call()[0]
            ref = g if ref is None else ref
            err = ((g.float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1e-2, f"{setting} changed the output: rel err {err:.2e}"
            us = 1000 * do_bench_cudagraph(call, rep=50, return_mode="median")
            rows.append((label, setting, us))
            print(f"{label:<22} {setting or 'defaults'!s:<52} {us:6.2f} us", flush=True)
    for name, value in DEFAULTS.items():
        setattr(scan, name, value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
