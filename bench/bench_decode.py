"""Batch-1 decode of a random-weight model on the GPU: the AR step against the weight-read floor,
and greedy tree iterations (verify + accept + replay) as ratios to the AR step.

Run on a CUDA machine from the repository root:

    PYTHONPATH=. python bench/bench_decode.py --preset mamba2-2.7b --out bench_decode.json

All figures come from one process: the floor is the model's parameter bytes over the
device-to-device copy bandwidth measured here (bytes read + written, 1 GiB buffers). Steps are
timed as CUDA-graph replays (median of many, after warm-up); "eager" rows are the same calls
without a graph. mamba_ssm is timed only if it is importable.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ssmspec.decoding.graphs import GreedyTreeGraph, StepGraph
from ssmspec.models.presets import build_model
from ssmspec.ops import dispatch, pdl
from ssmspec.ops.gemv import triton as gemv
from ssmspec.ops.step_update import triton as step_kernels
from ssmspec.trees.tree import Tree

RESULTS: dict = {}


def median_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median wall time of fn (synchronised, CUDA events), in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    n = 1 << 30
    src = torch.randn(n // 4, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), iters=20)
    del src, dst
    return 2 * n / (ms / 1000)


def param_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def prefilled_cache(model, prompt: torch.Tensor, max_len: int):
    cache = model.new_cache(prompt.shape[0], max_len)
    with torch.inference_mode():
        model(prompt, cache, last_only=True)
    return cache


def tree_tokens_following(model, cache, root: int, tree: Tree, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """Tree tokens whose first-child path is the model's own greedy continuation (so a greedy
    iteration can accept the whole depth), other nodes random. Returns (1, N) and the greedy chain."""
    work = cache.clone()
    chain, tok = [], torch.tensor([[root]], device="cuda")
    with torch.inference_mode():
        for _ in range(tree.max_depth + 1):
            tok = model.step(tok, work).argmax(-1)
            chain.append(int(tok))
    tokens = torch.randint(0, vocab, (1, tree.num_nodes), device="cuda")
    tokens[0, 0] = root
    first_path = tree.path(max(range(tree.num_nodes), key=lambda i: (tree.depths[i], -i)))
    for d, node in enumerate(first_path[1:]):
        tokens[0, node] = chain[d]
    return tokens, chain


def profile_top(fn, label: str, reps: int = 5, rows: int = 14) -> dict:
    """Per-kernel device time of fn (graph replays included), averaged over reps calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = getattr(e, "cuda_time_total", 0)
        if t > 0:
            events.append((t / reps, e.count / reps, e.key))
    events.sort(reverse=True)
    total = sum(t for t, _, _ in events)
    print(f"\n  profile of {label}: {total / 1000:.3f} ms of kernel time per call, top kernels:")
    for t, count, name in events[:rows]:
        print(f"    {t:9.1f} us {count:6.0f}x  {name[:90]}")
    return {"label": label, "kernel_ms": total / 1000, "top": [(name, t, count) for t, count, name in events[:rows]]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--trees", default="3,2,1;3,4,2,1", help="tree configurations separated by ';'")
    ap.add_argument("--skip-reference", action="store_true", help="skip the slow reference-backend rows")
    ap.add_argument("--profile", action="store_true", help="print per-kernel device time of the graphs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    print(dev, torch.__version__, flush=True)
    RESULTS["device"] = dev

    bw = copy_bandwidth()
    t0 = time.time()
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda")
    nbytes = param_bytes(model)
    floor_ms = nbytes / bw * 1000
    RESULTS.update(preset=args.preset, param_bytes=nbytes, copy_bw_TBps=bw / 1e12, floor_ms=floor_ms)
    print(f"{args.preset}: {nbytes / 1e9:.2f} GB of bf16 weights (built in {time.time() - t0:.0f}s); "
          f"copy {bw / 1e12:.2f} TB/s -> floor {floor_ms:.3f} ms", flush=True)

    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 32), device="cuda")
    ids = torch.randint(0, vocab, (1, 1), device="cuda")
    rows = []

    def record(name, ms, **extra):
        rows.append({"what": name, "ms": ms, **extra})
        print(f"  {name:<48} {ms:8.3f} ms", flush=True)

    logits_by_backend = {}
    for backend in (["triton"] if args.skip_reference else ["reference", "triton"]):
        dispatch.set_backend(backend)
        cache = prefilled_cache(model, prompt, 256)
        with torch.inference_mode():
            record(f"AR step eager [{backend}]", median_ms(lambda: model.step(ids, cache), iters=10 if backend == "reference" else 30))
        cache = prefilled_cache(model, prompt, 256)
        graph = StepGraph(model, cache)
        logits_by_backend[backend] = graph(ids).clone()
        cache = prefilled_cache(model, prompt, 256)
        graph = StepGraph(model, cache)
        record(f"AR step CUDA graph [{backend}]", median_ms(lambda: graph(ids), iters=100))
        if backend == "triton":
            gemv.ENABLED = False  # the same fused step with cuBLAS projections
            cache2 = prefilled_cache(model, prompt, 256)
            graph2 = StepGraph(model, cache2)
            record("AR step CUDA graph [triton, cuBLAS GEMV]", median_ms(lambda: graph2(ids), iters=100))
            gemv.ENABLED = True
            pdl.ENABLED = False  # the same kernels launched without programmatic dependent launch
            cache2 = prefilled_cache(model, prompt, 256)
            graph2 = StepGraph(model, cache2)
            record("AR step CUDA graph [triton, no PDL]", median_ms(lambda: graph2(ids), iters=100))
            pdl.ENABLED = True
            step_kernels.FUSE_OUT_PROJ = True  # the gated norm folded into the out_proj GEMV (off by default)
            cache2 = prefilled_cache(model, prompt, 256)
            graph2 = StepGraph(model, cache2)
            record("AR step CUDA graph [triton, norm in out_proj]", median_ms(lambda: graph2(ids), iters=100))
            step_kernels.FUSE_OUT_PROJ = False
            for flag, label in (("PRELOAD_STATE", "state read after the PDL wait"),
                                ("NORM_FROM_PARTS", "gated norm re-reduces its group")):
                setattr(step_kernels, flag, False)
                cache2 = prefilled_cache(model, prompt, 256)
                graph2 = StepGraph(model, cache2)
                record(f"AR step CUDA graph [triton, {label}]", median_ms(lambda: graph2(ids), iters=100))
                setattr(step_kernels, flag, True)
            del graph2, cache2
        if args.profile and backend == "triton":
            RESULTS.setdefault("profiles", []).append(profile_top(lambda: graph(ids), "AR step graph [triton]"))
        del graph, cache
    if "reference" in logits_by_backend:
        a, b = logits_by_backend["reference"].double(), logits_by_backend["triton"].double()
        rel = ((a - b).norm() / a.norm()).item()
        same = bool((a.argmax(-1) == b.argmax(-1)).all())
        RESULTS["step_logits_rel_err_triton_vs_reference"] = rel
        print(f"  step logits triton vs reference: rel err {rel:.2e}, same argmax {same}")

    dispatch.set_backend("triton")
    ar_ms = next(r["ms"] for r in rows if r["what"] == "AR step CUDA graph [triton]")
    tree_rows = []
    for spec in args.trees.split(";"):
        tree = Tree.from_config(tuple(int(v) for v in spec.split(",")))
        cache = prefilled_cache(model, prompt, 256)
        root = int(prompt[0, -1])
        tokens, chain = tree_tokens_following(model, cache, root, tree, vocab)
        with torch.inference_mode():
            eager_ms = median_ms(lambda: model.verify(tokens, tree, cache), iters=20)
        seqlen_before = int(cache.seqlen[0])
        g = GreedyTreeGraph(model, cache, tree)
        out, n = g(tokens)
        accepted = int(n[0]) - 1
        produced = out[0, : int(n[0])].tolist()
        matches = produced == chain[: len(produced)]
        advanced = int(cache.seqlen[0]) - seqlen_before
        snapshot = cache.clone()

        def iteration():
            cache.copy_(snapshot)  # same start every time: times verify+accept+replay of one iteration
            g(tokens)

        it_ms = median_ms(iteration, iters=50)
        if args.profile:
            RESULTS.setdefault("profiles", []).append(profile_top(iteration, f"tree iteration graph [{tree.num_nodes} nodes] (+ cache restore copy)"))
        copy_ms = median_ms(lambda: cache.copy_(snapshot), iters=50)
        net = it_ms - copy_ms
        gemv.ENABLED = False  # the same iteration with cuBLAS projections (no GEMV / skinny GEMM)
        g_cublas = GreedyTreeGraph(model, cache, tree)
        gemv.ENABLED = True

        def iteration_cublas():
            cache.copy_(snapshot)
            g_cublas(tokens)

        cublas_net = median_ms(iteration_cublas, iters=50) - copy_ms
        del g_cublas
        pdl.ENABLED = False
        g_nopdl = GreedyTreeGraph(model, cache, tree)
        pdl.ENABLED = True

        def iteration_nopdl():
            cache.copy_(snapshot)
            g_nopdl(tokens)

        nopdl_net = median_ms(iteration_nopdl, iters=50) - copy_ms
        del g_nopdl
        record(f"verify eager [{tree.num_nodes} nodes, {spec}]", eager_ms)
        record(f"verify+accept+replay graph [{tree.num_nodes} nodes]", net, ratio_to_ar=net / ar_ms)
        record(f"  same, cuBLAS projections [{tree.num_nodes} nodes]", cublas_net, ratio_to_ar=cublas_net / ar_ms)
        record(f"  same, no PDL [{tree.num_nodes} nodes]", nopdl_net, ratio_to_ar=nopdl_net / ar_ms)
        tree_rows.append({"tree": spec, "nodes": tree.num_nodes, "ms": net, "ratio": net / ar_ms, "accepted": accepted,
                          "greedy_chain_matches": matches, "cache_advanced": advanced})
        print(f"    accepted {accepted}/{tree.max_depth} drafted tokens; produced == step-graph greedy chain: {matches}; "
              f"cache advanced by {advanced}", flush=True)
        del g, cache, snapshot
    RESULTS["rows"] = rows
    RESULTS["trees"] = tree_rows

    try:
        import mamba_ssm  # noqa: F401

        RESULTS["mamba_ssm"] = "importable, not timed by this script"
    except ImportError:
        RESULTS["mamba_ssm"] = "not installed on this machine: baseline skipped"

    print(f"\n{dev}; {args.preset} random bf16 weights, fp32 states, batch 1")
    print(f"weight-read floor {floor_ms:.3f} ms ({nbytes / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s)")
    print(f"{'what':<50} {'ms':>8} {'x floor':>8} {'x AR':>6}")
    for r in rows:
        print(f"{r['what']:<50} {r['ms']:8.3f} {r['ms'] / floor_ms:8.2f} {r['ms'] / ar_ms:6.2f}")
    print(f"mamba_ssm: {RESULTS['mamba_ssm']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
