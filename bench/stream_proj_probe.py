"""Probe: the 16-node tree iteration with the verify's projections on the weight stream
(ops/stream_proj, SSMSPEC_STREAM_LAYERS=1) against the Triton verify, for ring settings.

Times the greedy tree iteration as bench_decode.py does (verify + accept + replay graph, pending
slots as the product gives them, full acceptance) on the Triton projections, then on the
weight-stream kernel built with each (slots, copies in flight) setting, then on Triton again, all
in one process, with the one-launch AR step for the ratio. The kernel variants build in parallel
first (about a minute each with nvcc).

Run on the GPU from the repository root:

    python3 bench/stream_proj_probe.py [--tree 3,2,1] [--variants "4,1;5,1;4,2"]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys

import torch

sys.path.insert(0, "bench")
from bench_decode import median_ms, prefilled_cache, time_tree_iteration  # noqa: E402
from ssmspec.decoding.graphs import StepGraph  # noqa: E402
from ssmspec.models.presets import build_model  # noqa: E402
from ssmspec.ops import dispatch, stream_layers  # noqa: E402
from ssmspec.ops.stream_proj import cuda as sp  # noqa: E402
from ssmspec.trees.tree import Tree  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--tree", default="3,2,1")
    ap.add_argument("--variants", default="4,1;5,1", help="';'-separated slots,in_flight settings")
    args = ap.parse_args()
    torch.manual_seed(0)
    dispatch.set_backend("triton")
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
    vocab = model.config.vocab_size
    tree = Tree.from_config(tuple(int(v) for v in args.tree.split(",")))
    prompt = torch.randint(0, vocab, (1, 32), device="cuda")
    ids = torch.randint(0, vocab, (1, 1), device="cuda")
    variants = [tuple(int(v) for v in spec.split(",")) for spec in args.variants.split(";")]
    m = model.layers[0].mixer
    shape = (m.in_proj.weight.shape[1], m.out_proj.weight.shape[1], m.in_proj.weight.shape[0])
    with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:  # nvcc builds in parallel
        list(pool.map(lambda v: sp._module(*shape, *v), variants))

    os.environ[stream_layers.cuda.ENV] = "1"
    cache = prefilled_cache(model, prompt, 256)
    step = StepGraph(model, cache)
    ar_ms = median_ms(lambda: step(ids), iters=100)
    del step, cache
    del os.environ[stream_layers.cuda.ENV]
    print(f"{torch.cuda.get_device_name()}; {args.preset}; one-launch AR step {ar_ms:.3f} ms; tree {args.tree} "
          f"({tree.num_nodes} nodes)", flush=True)
    rows = []

    def timed(label: str, stream: bool) -> None:
        if stream:
            os.environ[stream_layers.cuda.ENV] = "1"
        try:
            info = time_tree_iteration(model, prompt, tree, vocab)
        finally:
            os.environ.pop(stream_layers.cuda.ENV, None)
        rows.append((label, info["ms"]))
        print(f"  {label:<52} {info['ms']:.3f} ms = {info['ms'] / ar_ms:.3f}x AR; greedy chain matches: "
              f"{info['greedy_chain_matches']}, accepted {info['accepted']}", flush=True)

    timed("Triton projections", False)
    for slots, in_flight in variants:
        sp.SLOTS, sp.IN_FLIGHT = slots, in_flight
        model._stream_proj_runner = None  # rebuilt with this setting at the next verify
        timed(f"weight stream, {slots} slots, {in_flight} in flight", True)
    timed("Triton projections, again", False)
    print(f"\n{'what':<52} {'ms':>7} {'x AR':>6}")
    for label, ms in rows:
        print(f"{label:<52} {ms:7.3f} {ms / ar_ms:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
