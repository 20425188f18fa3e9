"""Probe: the 16-node tree iteration with the verify's projections on the weight stream
(ops/stream_proj, SSMSPEC_STREAM_LAYERS=1) against the Triton verify, for ring settings.

Times the greedy tree iteration as bench_decode.py does (verify + accept + replay graph, pending
slots as the product gives them, full acceptance) on the Triton projections, then on the
weight-stream kernel built with each (slots, copies in flight) setting, then on Triton again, all
in one process, with the one-launch AR step for the ratio. The kernel variants build in parallel
first (about a minute each with nvcc).

Run on the GPU from the repository root:

    python3 bench/stream_proj_probe.py [--tree 3,2,1] [--variants "4,1;5,1;4,2"] [--trace]

--trace instead builds the kernel with its TRACE stamps (globaltimer, per launch and CTA) and prints
where one tree iteration's launches spend their time, medians over CTAs and middle layers.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys

import torch

sys.path.insert(0, "bench")
from bench_decode import median_ms, prefilled_cache, time_tree_iteration, tree_tokens_following  # noqa: E402
from ssmspec.decoding.generate import pending_slots_for  # noqa: E402
from ssmspec.decoding.graphs import GreedyTreeGraph, StepGraph  # noqa: E402
from ssmspec.models.presets import build_model  # noqa: E402
from ssmspec.ops import dispatch, stream_layers  # noqa: E402
from ssmspec.ops.stream_proj import cuda as sp  # noqa: E402
from ssmspec.trees.tree import Tree  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--tree", default="3,2,1")
    ap.add_argument("--variants", default="4,1;5,1", help="';'-separated slots,in_flight settings")
    ap.add_argument("--trace", action="store_true", help="stamp one iteration's launches instead of timing")
    args = ap.parse_args()
    torch.manual_seed(0)
    dispatch.set_backend("triton")
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
    vocab = model.config.vocab_size
    tree = Tree.from_config(tuple(int(v) for v in args.tree.split(",")))
    prompt = torch.randint(0, vocab, (1, 32), device="cuda")
    ids = torch.randint(0, vocab, (1, 1), device="cuda")
    if args.trace:
        return trace(model, prompt, tree, vocab)
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
    os.environ[stream_layers.cuda.ENV] = "0"  # the Triton rows
    print(f"{torch.cuda.get_device_name()}; {args.preset}; one-launch AR step {ar_ms:.3f} ms; tree {args.tree} "
          f"({tree.num_nodes} nodes)", flush=True)
    rows = []

    def timed(label: str, stream: bool) -> None:
        if stream:
            os.environ[stream_layers.cuda.ENV] = "1"
        try:
            info = time_tree_iteration(model, prompt, tree, vocab)
        finally:
            os.environ[stream_layers.cuda.ENV] = "0"
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


# kernel.cu's TRACE stamps: consumer thread 0 (1-7), the producer (8-11)
PHASES = [("start -> PDL wait over", 0, 1), ("g's first half fetched", 1, 2), ("out_proj slots", 2, 3),
          ("h' epilogue", 3, 4), ("grid barrier", 4, 5), ("h' fetched, rms", 5, 6), ("in_proj slots", 6, 7)]


def trace(model, prompt, tree, vocab) -> int:
    """Stamps of one captured tree iteration's weight-stream launches: per phase, the median over
    CTAs and layers 8..55 (us); the chain between launches (last CTA done -> first past its wait)."""
    sp.TRACE = True
    cache = prefilled_cache(model, prompt, 256, pending_slots_for(tree, model))
    tokens, _ = tree_tokens_following(model, cache, int(prompt[0, -1]), tree, vocab)
    os.environ[stream_layers.cuda.ENV] = "1"
    try:
        # the stamps' buffer is set before the first launch (the graph's warm-up): the kernel writes it
        runner = sp.StreamProj(model, torch.device("cuda"))
        model._stream_proj_runner = (torch.device("cuda", torch.cuda.current_device()), runner)  # as verify keys it
        ctas = torch.cuda.get_device_properties(0).multi_processor_count
        launches = len(model.layers) + 1
        buffer = torch.zeros(launches, ctas, 16, dtype=torch.int64, device="cuda")
        runner.module.set_trace(buffer)
        graph = GreedyTreeGraph(model, cache, tree)
        snapshot = cache.clone()
        for _ in range(3):
            cache.copy_(snapshot)
            graph(tokens)
        cache.copy_(snapshot)
        runner.counter[1] = 0  # the next replay's launches are 0 .. launches - 1
        torch.cuda.synchronize()
        graph(tokens)
        torch.cuda.synchronize()
    finally:
        os.environ[stream_layers.cuda.ENV] = "0"
    st = buffer.double().cpu() / 1e3  # us
    mid = range(8, 56)
    med = lambda v: float(v.median())  # noqa: E731
    print(f"one iteration, tree {tree.num_nodes} nodes: {launches} launches of {ctas} CTAs; us, medians over CTAs and "
          f"launches {mid.start}..{mid.stop - 1}")
    for name, a, b in PHASES:
        print(f"  {name:<28} {med(st[mid.start:mid.stop, :, b] - st[mid.start:mid.stop, :, a]):7.2f}")
    print(f"  {'producer: ring full':<28} {med(st[mid.start:mid.stop, :, 8]):7.2f}")
    print(f"  {'producer: copy in flight':<28} {med(st[mid.start:mid.stop, :, 9]):7.2f}")
    print(f"  {'producer: first to last copy':<28} {med(st[mid.start:mid.stop, :, 11] - st[mid.start:mid.stop, :, 10]):7.2f}")
    span = [float(st[i, :, 7].max() - st[i, :, 1].min()) for i in mid]
    chain = [float(st[i, :, 1].min() - st[i - 1, :, 7].max()) for i in mid]
    early = [float(st[i, :, 1].min() - st[i, :, 0].min()) for i in mid]
    layer = [float(st[i + 1, :, 1].min() - st[i, :, 1].min()) for i in mid]
    print(f"  {'launch: first past wait -> last done':<36} {sorted(span)[len(span) // 2]:7.2f}")
    print(f"  {'chain: last done -> next first past wait':<36} {sorted(chain)[len(chain) // 2]:7.2f}")
    print(f"  {'first CTA start -> first past wait':<36} {sorted(early)[len(early) // 2]:7.2f}")
    print(f"  {'layer: past wait -> next past wait':<36} {sorted(layer)[len(layer) // 2]:7.2f}")
    n_in = model.layers[0].mixer.in_proj.weight.shape[0]
    rows = torch.tensor([n_in * (c + 1) // ctas - n_in * c // ctas for c in range(ctas)])
    last = st[mid.start:mid.stop, :, 7].argmax(dim=1)
    print(f"  the last CTA to finish has {int(rows.max())} in_proj rows (as {int((rows == rows.max()).sum())} of the "
          f"{ctas} CTAs do) in {float((rows[last] == rows.max()).float().mean()):.0%} of the launches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
