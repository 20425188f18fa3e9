"""L2 prefetch plans (ssmspec/ops/prefetch.py) timed inside the AR step and the tree iteration.

Builds the model once (norms folded, as `generate` runs it) and, for each plan, captures the AR
step graph and the greedy tree iterations again and times them as bench_decode.py does. Every
plan's row is followed by a row with no prefetch, so each ratio is against a baseline timed
seconds apart in the same process. Each plan's AR logits must equal the no-prefetch logits
bit for bit (a prefetch is only a hint).

Run on the GPU from the repository root (after `pip install --no-deps -e .`):

    python3 bench/prefetch_sweep.py --preset mamba2-2.7b --trees "3,2,1;3,4,2,1"
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import median_ms, prefilled_cache, time_tree_iteration  # noqa: E402
from ssmspec.decoding.graphs import StepGraph  # noqa: E402
from ssmspec.models.presets import build_model  # noqa: E402
from ssmspec.ops import dispatch, prefetch  # noqa: E402
from ssmspec.trees.tree import Tree  # noqa: E402

MB = 1 << 20
AR_PLANS = {
    "step: out_proj 0-4 MB": {"step": ("out_proj", 0, 4 * MB)},
    "step: out_proj 0-8 MB": {"step": ("out_proj", 0, 8 * MB)},
    "step: out_proj 0-16 MB": {"step": ("out_proj", 0, 16 * MB)},
    "step: out_proj all": {"step": ("out_proj", 0, 1 << 40)},
    "step: out_proj 8-16 MB": {"step": ("out_proj", 8 * MB, 8 * MB)},
    "step: out_proj 12-26 MB": {"step": ("out_proj", 12 * MB, 1 << 40)},
    "step: next in_proj 0-8 MB": {"step": ("next", 0, 8 * MB)},
    "step: next in_proj 0-16 MB": {"step": ("next", 0, 16 * MB)},
    "out: next in_proj 0-4 MB": {"step_out": ("next", 0, 4 * MB)},
    "out: next in_proj 0-8 MB": {"step_out": ("next", 0, 8 * MB)},
    "out: next in_proj 0-16 MB": {"step_out": ("next", 0, 16 * MB)},
    "step: out_proj 0-8 MB + out: next 0-8 MB": {"step": ("out_proj", 0, 8 * MB), "step_out": ("next", 0, 8 * MB)},
}
TREE_PLANS = {
    "conv: out_proj 0-8 MB": {"tree_conv": ("out_proj", 0, 8 * MB)},
    "conv: out_proj 0-16 MB": {"tree_conv": ("out_proj", 0, 16 * MB)},
    "conv: out_proj all": {"tree_conv": ("out_proj", 0, 1 << 40)},
    "scan: out_proj 0-8 MB": {"tree_scan": ("out_proj", 0, 8 * MB)},
    "conv 0-8 + scan 8-16 MB": {"tree_conv": ("out_proj", 0, 8 * MB), "tree_scan": ("out_proj", 8 * MB, 8 * MB)},
    "conv 0-12 + scan 12-26 MB": {"tree_conv": ("out_proj", 0, 12 * MB), "tree_scan": ("out_proj", 12 * MB, 1 << 40)},
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--trees", default="3,2,1;3,4,2,1")
    ap.add_argument("--evict-last", action="store_true", help="also time the best plans with the evict-last hint")
    ap.add_argument("--only", default="", help="comma-separated plan names to time (default: all)")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
    dispatch.set_backend("triton")
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 32), device="cuda")
    ids = torch.randint(0, vocab, (1, 1), device="cuda")
    only = {s.strip() for s in args.only.split(",") if s.strip()}

    def ar_ms(plan, warm_s=0.0):
        prefetch.PLAN.clear()
        prefetch.PLAN.update(plan)
        cache = prefilled_cache(model, prompt, 256)
        graph = StepGraph(model, cache)
        snapshot = cache.clone()
        logits = graph(ids).clone()
        cache.copy_(snapshot)
        start = time.time()
        while time.time() - start < warm_s:
            for _ in range(50):
                graph(ids)
            cache.copy_(snapshot)
            torch.cuda.synchronize()
        ms = median_ms(lambda: graph(ids), iters=100)
        prefetch.PLAN.clear()
        return ms, logits

    rows = []
    base_ms, base_logits = ar_ms({}, warm_s=3.0)
    print(f"AR step, no prefetch: {base_ms:.3f} ms", flush=True)
    evicts = [False, True] if args.evict_last else [False]
    for evict in evicts:
        prefetch.EVICT_LAST = evict
        for name, plan in AR_PLANS.items():
            if only and name not in only:
                continue
            ms, logits = ar_ms(plan)
            ref, _ = ar_ms({})
            same = bool(torch.equal(logits, base_logits))
            label = f"AR {name}{' (evict_last)' if evict else ''}"
            rows.append((label, ms, ref, same))
            print(f"  {label:<56} {ms:7.3f} ms  none {ref:7.3f}  x{ms / ref:6.3f}  same logits {same}", flush=True)
    prefetch.EVICT_LAST = False

    for spec in args.trees.split(";"):
        tree = Tree.from_config(tuple(int(v) for v in spec.split(",")))
        for evict in evicts:
            prefetch.EVICT_LAST = evict
            for name, plan in TREE_PLANS.items():
                if only and name not in only:
                    continue
                prefetch.PLAN.clear()
                prefetch.PLAN.update(plan)
                info = time_tree_iteration(model, prompt, tree, vocab)
                prefetch.PLAN.clear()
                ref = time_tree_iteration(model, prompt, tree, vocab)
                label = f"{tree.num_nodes} nodes {name}{' (evict_last)' if evict else ''}"
                ok = info["greedy_chain_matches"] and info["accepted"] == ref["accepted"]
                rows.append((label, info["ms"], ref["ms"], ok))
                print(f"  {label:<56} {info['ms']:7.3f} ms  none {ref['ms']:7.3f}  x{info['ms'] / ref['ms']:6.3f}  "
                      f"same tokens {ok}", flush=True)
        prefetch.EVICT_LAST = False

    print(f"\n{'plan':<60} {'ms':>8} {'none':>8} {'ratio':>7} same")
    for label, ms, ref, same in rows:
        print(f"{label:<60} {ms:8.3f} {ref:8.3f} {ms / ref:7.3f} {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
