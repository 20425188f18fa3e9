"""Where a batch-1 decode step's time goes: a kernel timeline of one CUDA-graph step.

Prints, for two consecutive middle layers, each kernel's start (relative to the layer's first
kernel), duration and the gap since the previous kernel ended (negative: it overlapped, as
programmatic dependent launch allows), then per-kind averages over all layers. Run on a CUDA
machine from the repository root:

    python bench/trace_step.py --preset mamba2-2.7b [--unfolded] [--tree 3,2,1]

With --tree, the traced call is one greedy tree iteration (verify + accept + replay, one CUDA
graph) from the same prefilled state each time; the cache-restore copies are left out.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

import torch

from ssmspec.decoding.graphs import GreedyTreeGraph, StepGraph
from ssmspec.models.presets import build_model
from ssmspec.ops import dispatch
from ssmspec.trees import Tree


def kernel_events(fn, reps: int = 3) -> list[tuple[float, float, str]]:
    """(start us, duration us, name) of every GPU kernel of the last of `reps` calls of fn."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    events = sorted((e["ts"], e["dur"], e["name"]) for e in trace["traceEvents"]
                    if e.get("cat") in ("kernel", "gpu_memcpy") and "dur" in e)
    # split the calls at the biggest gaps between kernels
    gaps = sorted(range(1, len(events)), key=lambda i: events[i][0] - (events[i - 1][0] + events[i - 1][1]))[-(reps - 1):]
    start = max(gaps) if gaps else 0
    return events[start:]


def event_ms(restore, graph, iters: int = 30) -> float:
    """Median ms of the graph's replay alone by CUDA events, after restore() each time, as
    bench_decode.py times tree iterations."""
    from bench_decode import restored_call_times  # bench/ is this script's directory

    return restored_call_times(restore, graph.graph.replay, iters)[iters // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--unfolded", action="store_true", help="keep the norm weights (no fused-norm routes)")
    ap.add_argument("--layer", type=int, default=30)
    ap.add_argument("--all", action="store_true", help="print every kernel of the call, not two layers")
    ap.add_argument("--full-accept", action="store_true",
                    help="with --tree: tree tokens along the target's greedy chain (every level accepted, as "
                         "bench_decode.py times it) instead of random ones")
    ap.add_argument("--tree", default=None, help="trace a greedy tree iteration of this configuration, e.g. 3,2,1")
    ap.add_argument("--pending", type=int, default=None,
                    help="with --tree: pending input slots of the cache (models/cache.py; 0: none); default: as the "
                         "product's fast path gives the tree (the traced iteration starts from an empty slot set, "
                         "so it appends without flushing)")

    args = ap.parse_args()
    dispatch.set_backend("triton")
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda")
    if not args.unfolded:
        model.fold_norm_weights_()
    tree = Tree.from_config([int(b) for b in args.tree.split(",")]) if args.tree else None
    pending = 0
    if tree is not None:
        from ssmspec.decoding.generate import pending_slots_for

        pending = pending_slots_for(tree, model) if args.pending is None else args.pending
    cache = model.new_cache(1, 256, pending=pending)
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, 16), device="cuda"), cache)
    if args.tree:
        tokens = torch.randint(0, 1000, (1, tree.num_nodes), device="cuda")
        if args.full_accept:
            from bench_decode import tree_tokens_following  # bench/ is this script's directory

            tokens, _ = tree_tokens_following(model, cache, int(tokens[0, 0]), tree, model.config.vocab_size)
        graph = GreedyTreeGraph(model, cache, tree)
        snapshot = cache.clone()

        def restore():
            cache.copy_(snapshot)

        def call():
            restore()
            graph(tokens)
        what = f"tree {args.tree} ({tree.num_nodes} nodes, {pending} pending slots) iteration"
    else:
        ids = torch.randint(0, 1000, (1, 1), device="cuda")
        graph = StepGraph(model, cache)
        graph(ids)
        call, restore, what = (lambda: graph(ids)), (lambda: None), "AR step"
    # events first: replays after torch.profiler has run are slower (BENCHMARKS.md, run 54)
    replay_us = event_ms(restore, graph) * 1e3
    # the cache restore's copies are device-to-device; a host-to-device copy is the graph's own
    events = [e for e in kernel_events(call) if not e[2].startswith("Memcpy DtoD")]
    t0, t_end = events[0][0], events[-1][0] + events[-1][1]
    print(f"{args.preset} {'unfolded' if args.unfolded else 'folded'} {what}: {len(events)} kernels, "
          f"first start to last end {t_end - t0:.1f} us; CUDA events around the replay {replay_us:.1f} us")
    per_layer = (len(events) - 8) / len(model.layers)
    kinds = collections.defaultdict(list)
    prev_end = None
    for i, (ts, dur, name) in enumerate(events):
        short = name.split("(")[0][:40]
        gap = None if prev_end is None else ts - prev_end
        kinds[short].append((dur, gap))
        prev_end = ts + dur
    first = 1 if args.all else int(args.layer * per_layer)
    shown = len(events) - 1 if args.all else int(2 * per_layer)
    convs = [i for i, e in enumerate(events) if e[2].startswith("_tree_conv")]
    if args.tree and not args.all and len(convs) > args.layer + 2:  # align the window on a layer's conv
        first, shown = convs[args.layer], convs[args.layer + 2] - convs[args.layer]
    layer_start = events[first][0]
    print("every kernel:" if args.all else f"layer {args.layer}..{args.layer + 1} (~{per_layer:.1f} kernels per layer):")
    prev_end = events[first - 1][0] + events[first - 1][1]
    for ts, dur, name in events[first:first + shown]:
        print(f"  {name.split('(')[0][:40]:<40} start {ts - layer_start:8.2f}  dur {dur:7.2f}  gap {ts - prev_end:7.2f}")
        prev_end = ts + dur
    print("per kind (mean over the step): duration, gap since the previous kernel ended")
    for short, rows in sorted(kinds.items(), key=lambda kv: -sum(d for d, _ in kv[1])):
        gaps = [g for _, g in rows if g is not None]
        print(f"  {short:<40} {len(rows):4d}x  dur {sum(d for d, _ in rows) / len(rows):7.2f}  "
              f"gap {sum(gaps) / max(len(gaps), 1):7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
