"""Probe: what the pending SSM inputs (models/cache.py) cost and save, kernel by kernel, at the
mamba2-2.7b shape (64 layers, bf16 activations, fp32 states, batch 1).

Times, as CUDA graphs of all 64 layers' launches (each layer its own tensors, so the states
stream from memory as in the model; median of bench_decode's spin-timed calls):
- the gated tree scan of 16 and 64 nodes without pending inputs and with L slots, count valid;
- the replay of all layers: plain, pending append, pending flush; and the count update.
Run on the GPU from the repository root: `python3 bench/pending_probe.py [--slots 16,32]`.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

sys.path.insert(0, "bench")
from bench_decode import median_ms  # noqa: E402

from ssmspec.ops.state_replay import triton as SR  # noqa: E402
from ssmspec.ops.tree_scan import triton as TS  # noqa: E402
from ssmspec.trees import Tree  # noqa: E402

LAYERS, H, P, S, G, CONV = 64, 80, 64, 128, 1, 5376
BF16, DEV = torch.bfloat16, "cuda"


def layer_acts(n: int):
    proj = torch.randn(1, n, H * P + CONV + H, device=DEV, dtype=BF16)
    z, xBC, dt_raw = proj.split([H * P, CONV, H], dim=-1)
    conv = torch.randn(1, n, CONV, device=DEV, dtype=BF16) * 0.3
    x, B, C = conv.split([H * P, S, S], dim=-1)
    dt0 = torch.exp(torch.rand(H, device=DEV) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return {"z": z, "xBC": xBC, "dt_raw": dt_raw, "x": x.unflatten(-1, (H, P)), "B": B.unflatten(-1, (G, S)),
            "C": C.unflatten(-1, (G, S)), "dt_bias": dt0 + torch.log(-torch.expm1(-dt0)),
            "A": -(1 + torch.rand(H, device=DEV) * 15), "D": torch.randn(H, device=DEV),
            "dt": torch.rand(1, n, H, device=DEV) * 0.1,
            "h0": torch.randn(1, H, P, S, device=DEV), "conv_state": torch.randn(1, CONV, 3, device=DEV, dtype=BF16)}


def slots(capacity: int, count: int):
    return (torch.randn(1, capacity, H, P, device=DEV, dtype=BF16), torch.rand(1, capacity, H, device=DEV) * 0.1,
            torch.randn(1, capacity, G, S, device=DEV, dtype=BF16) * 0.3,
            torch.full((1,), count, dtype=torch.long, device=DEV))


def graph_ms(fn) -> float:
    fn()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, iters=50)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", default="16,32", help="pending slot capacities to time")
    ap.add_argument("--replay-only", action="store_true", help="time only the replay rows")
    ap.add_argument("--scan-knobs", action="store_true",
                    help="also time the scans with slots over warps and state chunk sizes (ops/tree_scan knobs)")
    args = ap.parse_args()
    capacities = [int(c) for c in args.slots.split(",")]
    rows = []
    for spec in ("3,2,1", "3,4,2,1"):
        tree = Tree.from_config(tuple(int(v) for v in spec.split(",")))
        n, parents = tree.num_nodes, tree.parents_tensor(DEV)
        acts = [layer_acts(n) for _ in range(LAYERS)]

        def scans(pending_per_layer):
            def run():
                for a, p in zip(acts, pending_per_layer):
                    TS.tree_scan_gated(a["x"], a["dt_raw"], a["dt_bias"], 0.0, math.inf, a["A"], a["B"], a["C"], a["D"],
                                       a["z"], parents, a["h0"], pending=p)
            return run

        for cap in ([] if args.replay_only else [0] + capacities):
            if not cap:
                rows.append((f"{n}-node scan x64, no pending", graph_ms(scans([None] * LAYERS))))
                continue
            rows.append((f"{n}-node scan x64, {cap} slots all valid",
                         graph_ms(scans([slots(cap, cap) for _ in range(LAYERS)]))))
            if args.scan_knobs:
                for warps in (4, 8, 16):
                    for block_s in (32, 64, 128):
                        TS.SCAN_WARPS, TS.SCAN_BLOCK_S = warps, block_s
                        rows.append((f"{n}-node scan x64, {cap} slots, {warps} warps, S chunks of {block_s}",
                                     graph_ms(scans([slots(cap, cap) for _ in range(LAYERS)]))))
                        TS.SCAN_WARPS = TS.SCAN_BLOCK_S = None

        width = tree.max_depth + 1
        deepest = max(range(n), key=lambda i: len(tree.path(i)))
        path = torch.tensor([tree.path(deepest)], device=DEV)
        path_len = torch.full((1,), width, device=DEV)
        lists = [[a[k] for a in acts] for k in ("conv_state", "h0", "xBC", "x", "dt", "A", "B")]
        rows.append((f"{n}-node replay x64 layers, plain", graph_ms(lambda: SR.replay_states_layers(*lists, path, path_len))))
        for cap in capacities:
            for programs in (0, 8, 16, 32):
                SR.PENDING_SSM_PROGRAMS = programs
                for what, count in (("append", 0), ("flush", cap - width)):
                    per = [slots(cap, count) for _ in range(LAYERS)]
                    pend = ([p[0] for p in per], [p[1] for p in per], [p[2] for p in per], per[0][3])

                    def replay(pend=pend, count=count):
                        pend[3].fill_(count)  # the same case at every replay
                        SR.replay_states_layers(*lists, path, path_len, pend)
                    rows.append((f"{n}-node replay x64 layers, {cap} slots, {what}, "
                                 f"{programs or 'all'} tile programs", graph_ms(replay)))
            SR.PENDING_SSM_PROGRAMS = 16
        seqlen, count = torch.zeros(1, dtype=torch.long, device=DEV), torch.zeros(1, dtype=torch.long, device=DEV)
        rows.append(("count update (advance_positions)", graph_ms(lambda: SR.advance_positions(seqlen, count, path_len,
                                                                                                 width, 32))))
        rows.append(("count fill (torch, as in the replay rows)", graph_ms(lambda: count.fill_(0))))
        del acts
    print(f"\n{torch.cuda.get_device_name()}; mamba2-2.7b layer shapes, batch 1")
    for what, ms in rows:
        print(f"  {what:<52} {ms * 1000:9.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
