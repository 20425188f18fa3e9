"""The deferred SSM replay against the ordinary one, in the greedy tree iteration (issue 3, round 9).

`GreedyTreeGraph(defer_replay=True)` leaves each iteration's SSM-state update to the next
verify, whose tree scan applies it layer by layer (ops/tree_scan). This times one greedy
tree iteration of the 2.7b model as a CUDA graph, in one process:

- replay: no deferral (the ordinary replay at the end of the iteration), the baseline;
- deferred: the model's deferred replay;
- deferred, nothing pending: the same graph started with nothing pending (what the apply costs).

(Earlier versions of this probe, round 9, timed the apply work in its own early-launched
kernel before in_proj or before the conv, on a second stream, and in the conv's launch: BENCHMARKS.md.)

Each timed call starts from the state after one iteration (its path pending), restored outside
the timed region, as bench_decode.py does. Usage (repository root, CUDA machine):

    cd bench; python3 defer_probe.py [--trees "3,2,1;3,4,2,1"] [--rounds 2]
"""
from __future__ import annotations

import argparse

import torch
from bench_decode import prefilled_cache, restored_call_times, tree_tokens_following
from ssmspec.trees.tree import Tree

from ssmspec.decoding.graphs import GreedyTreeGraph
from ssmspec.models.presets import build_model
from ssmspec.ops import dispatch


def time_placement(model, prompt, tree, vocab, name: str) -> tuple[float, bool]:
    cache = prefilled_cache(model, prompt, 256)
    tokens, chain = tree_tokens_following(model, cache, int(prompt[0, -1]), tree, vocab)
    g = GreedyTreeGraph(model, cache, tree, defer_replay=name != "replay")
    out, n = g(tokens)
    ok = out[0, : int(n[0])].tolist() == chain[: int(n[0])]
    snapshot = cache.clone()
    if name.endswith("nothing pending"):
        snapshot.pending_len.zero_()
    for _ in range(5):
        cache.copy_(snapshot)
        g(tokens)
    times = restored_call_times(lambda: cache.copy_(snapshot), lambda: g(tokens), 50)
    return times[len(times) // 2], ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--trees", default="3,2,1;3,4,2,1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--placements", default="replay;deferred;deferred, nothing pending")
    args = ap.parse_args()
    torch.manual_seed(0)
    dispatch.set_backend("triton")
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 32), device="cuda")
    names = args.placements.split(";")
    table = []
    for spec in args.trees.split(";"):
        tree = Tree.from_config(tuple(int(v) for v in spec.split(",")))
        for r in range(args.rounds):
            for name in names:
                ms, ok = time_placement(model, prompt, tree, vocab, name)
                table.append((tree.num_nodes, r, name, ms, ok))
                print(f"{tree.num_nodes:3d} nodes round {r}: {name:<34} {ms:7.3f} ms  greedy chain {ok}", flush=True)
    print(f"\n{torch.cuda.get_device_name()}; {args.preset}, folded, greedy iteration graph, ms (x replay)")
    for nodes in sorted({t[0] for t in table}):
        base = min(t[3] for t in table if t[0] == nodes and t[2] == "replay")
        for name in names:
            vals = [t[3] for t in table if t[0] == nodes and t[2] == name]
            print(f"{nodes:3d} nodes  {name:<34} " + "  ".join(f"{v:7.3f}" for v in vals)
                  + f"   x{min(vals) / base:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
