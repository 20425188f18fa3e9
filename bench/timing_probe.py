"""How bench_decode.py's per-call event timing treats the host's submission of a graph.

Before run 80, bench_decode.py timed one graph replay between two CUDA events after a synchronize.
For the tree iteration a cache restore (~130 copies) was queued just before the start event; the
AR step had nothing queued before its start event, so the time the host takes to submit
`ids.copy_` and the graph replay could fall inside its measured interval. This times, in one
process, on the folded model, with bench_decode.py's timer with and without its spin:

- AR step as bench_decode.py did (idle GPU before the start event);
- AR step with a GPU-side spin (torch.cuda._sleep) queued before the start event;
- AR step as 100 back-to-back replays between two events, divided by 100;
- the tree iterations as bench_decode.py did (restore before the start event), and with a spin
  queued after the restore.

Run on the GPU from the repository root (after `pip install --no-deps -e .`):

    python3 bench/timing_probe.py --preset mamba2-2.7b
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import SPIN_CYCLES, prefilled_cache, restored_call_times, tree_tokens_following  # noqa: E402
from ssmspec.decoding.graphs import GreedyTreeGraph, StepGraph  # noqa: E402
from ssmspec.models.presets import build_model  # noqa: E402
from ssmspec.ops import dispatch  # noqa: E402
from ssmspec.trees.tree import Tree  # noqa: E402

# This probe studies the Triton kernels; the default mode would take the one-launch CUDA kernels
# (ops/stream_layers, ops/stream_proj) where they run.
os.environ.setdefault("SSMSPEC_STREAM_LAYERS", "0")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--trees", default="3,2,1;3,4,2,1")
    ap.add_argument("--rounds", type=int, default=3, help="alternations of the AR variants")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
    dispatch.set_backend("triton")
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 32), device="cuda")
    ids = torch.randint(0, vocab, (1, 1), device="cuda")

    cache = prefilled_cache(model, prompt, 256)
    graph = StepGraph(model, cache)
    snapshot = cache.clone()
    start = time.time()
    while time.time() - start < 3.0:  # as bench_decode.py: off the idle clocks first
        for _ in range(50):
            graph(ids)
        cache.copy_(snapshot)
        torch.cuda.synchronize()

    def back_to_back(n=100):
        times = []
        for _ in range(10):
            cache.copy_(snapshot)
            torch.cuda._sleep(SPIN_CYCLES)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(n):
                graph(ids)
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / n)
        return sorted(times)[len(times) // 2]

    rows = []
    for r in range(args.rounds):
        plain = restored_call_times(lambda: None, lambda: graph(ids), 100, spin=False)[50]
        spun = restored_call_times(lambda: None, lambda: graph(ids), 100)[50]
        b2b = back_to_back()
        cache.copy_(snapshot)
        rows += [(f"AR step, idle GPU before the start event (bench_decode before run 80) #{r}", plain),
                 (f"AR step, GPU spin before the start event #{r}", spun),
                 (f"AR step, 100 back-to-back replays / 100 #{r}", b2b)]
        for label, ms in rows[-3:]:
            print(f"  {label:<60} {ms:7.3f} ms", flush=True)

    for spec in args.trees.split(";"):
        tree = Tree.from_config(tuple(int(v) for v in spec.split(",")))
        tcache = prefilled_cache(model, prompt, 256)
        tokens, _ = tree_tokens_following(model, tcache, int(prompt[0, -1]), tree, vocab)
        g = GreedyTreeGraph(model, tcache, tree)
        g(tokens)
        tsnap = tcache.clone()
        for _ in range(5):
            tcache.copy_(tsnap)
            g(tokens)

        def restore(c=tcache, snap=tsnap):
            c.copy_(snap)

        def call(tree_graph=g, t=tokens):
            tree_graph(t)

        for r in range(2):
            plain = restored_call_times(restore, call, 50, spin=False)[25]
            spun = restored_call_times(restore, call, 50)[25]
            rows += [(f"{tree.num_nodes}-node iteration, restore before the start event (before run 80) #{r}", plain),
                     (f"{tree.num_nodes}-node iteration, restore + spin before the start event #{r}", spun)]
            for label, ms in rows[-2:]:
                print(f"  {label:<60} {ms:7.3f} ms", flush=True)
    print(f"\n{'what':<76} {'ms':>8}")
    for label, ms in rows:
        print(f"{label:<76} {ms:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
