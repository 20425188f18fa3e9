"""Batch-1 decode of a random-weight model on the GPU: the AR step against the weight-read floor,
and greedy tree iterations (verify + accept + replay) as ratios to the AR step.

Run on a CUDA machine from the repository root:

    PYTHONPATH=. python bench/bench_decode.py --preset mamba2-2.7b --out bench_decode.json

All figures come from one process: the floor is the model's parameter bytes over the
device-to-device copy bandwidth measured here (bytes read + written, 1 GiB buffers). Steps are
timed as CUDA-graph replays (median of many, after warm-up); "eager" rows are the same calls
without a graph. mamba_ssm's own decode is timed against ours by bench/bench_mamba_ssm.py.

The rows run the Triton kernels only (SSMSPEC_STREAM_LAYERS=0) unless they say "one-launch" or
"weight stream": the product's default mode takes those CUDA kernels where they can run (the AR
step; verifies of up to 16 nodes) and the Triton kernels elsewhere. The last table gives the
default mode's ratios.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

from ssmspec.decoding.generate import PENDING_MAX_NODES, PENDING_SLOTS, pending_slots_for
from ssmspec.decoding.graphs import GreedyTreeGraph, StepGraph
from ssmspec.models.presets import build_model
from ssmspec.ops import paths, stream_layers, stream_proj
from ssmspec.trees.tree import Tree

RESULTS: dict = {}


def median_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    """Median GPU time of fn (CUDA events, synchronised, a spin before each; see
    `restored_call_times`), in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return restored_call_times(lambda: None, fn, iters)[iters // 2]


def gpu_state() -> str:
    """The GPU's SM and memory clocks, temperature, power and active clock-limit reasons (nvidia-smi),
    printed beside the rows that vary most between processes, or why not."""
    import subprocess

    fields = "clocks.sm,clocks.mem,temperature.gpu,power.draw,clocks_throttle_reasons.active"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        return f"(nvidia-smi: {e})"
    return f"(sm, mem, temp, power, limits: {out})"


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


def prefilled_cache(model, prompt: torch.Tensor, max_len: int, pending: int = 0):
    cache = model.new_cache(prompt.shape[0], max_len, pending=pending)
    with torch.inference_mode():
        model(prompt, cache, last_only=True)
    return cache


def tree_tokens_following(model, cache, root: int, tree: Tree, vocab: int) -> tuple[torch.Tensor, list[int]]:
    """Tree tokens whose first-child path is the target's own greedy continuation as `verify`
    computes it (so a greedy iteration accepts the whole depth), other nodes random. Built level
    by level from verify's own argmax: the step path's bf16 rounding can pick another token at a
    near tie, which would make iterations accept less and replay less than the full depth.
    Returns (1, N) and the greedy chain (the path's tokens after the root, then the bonus)."""
    tokens = torch.randint(0, vocab, (1, tree.num_nodes), device="cuda")
    tokens[0, 0] = root
    first_path = tree.path(max(range(tree.num_nodes), key=lambda i: (tree.depths[i], -i)))
    with torch.inference_mode():
        for d in range(len(first_path) - 1):
            logits, _ = model.verify(tokens, tree, cache)  # the cache is left untouched
            tokens[0, first_path[d + 1]] = logits[0, first_path[d]].argmax()
        logits, _ = model.verify(tokens, tree, cache)
    return tokens, [int(logits[0, node].argmax()) for node in first_path]


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


def time_tree_iteration(model, prompt, tree: Tree, vocab: int, pending: int | None = None) -> dict:
    """One greedy tree iteration (verify + device-side accept + replay) as a CUDA graph, timed
    from a fixed state each time (the cache restore outside the timed region).

    With pending slots (the product's fast path; models/cache.py) an iteration's cost depends on
    where it falls in the slots' cycle: most append their accepted inputs, one in a cycle flushes
    them into the states. So the iterations of one whole cycle are run for real first, each with
    tokens whose first-child path is the target's greedy continuation from that iteration's
    state (every iteration accepts its full depth, the fastest the slots fill), and each is then
    timed from its own snapshot; "ms" is their mean, the steady-state cost per iteration.
    pending: the slots (None: as the product's fast path gives this tree)."""
    if pending is None:
        pending = pending_slots_for(tree, model)
    cache = prefilled_cache(model, prompt, 256, pending)
    root = int(prompt[0, -1])
    g = GreedyTreeGraph(model, cache, tree)
    positions = []  # (snapshot, tokens) of each iteration of one cycle
    info = {"accepted": [], "greedy_chain_matches": True, "cache_advanced": [], "pending_counts": []}
    while True:
        tokens, chain = tree_tokens_following(model, cache, root, tree, vocab)
        positions.append((cache.clone(), tokens))
        seqlen_before = int(cache.seqlen[0])
        out, n = g(tokens)
        produced = out[0, : int(n[0])].tolist()
        info["accepted"].append(int(n[0]) - 1)
        info["greedy_chain_matches"] &= produced == chain[: len(produced)]
        info["cache_advanced"].append(int(cache.seqlen[0]) - seqlen_before)
        count = 0 if cache.pending_count is None else int(cache.pending_count[0])
        info["pending_counts"].append(count)
        root = produced[-1]
        if count == 0 or len(positions) > 64:  # flushed (or no slots): the cycle is complete
            break
    medians = []
    for snapshot, tokens in positions:
        for _ in range(5):
            cache.copy_(snapshot)
            g(tokens)
        times = restored_call_times(lambda snapshot=snapshot: cache.copy_(snapshot), lambda tokens=tokens: g(tokens), 50)
        medians.append(times[len(times) // 2])
        info.setdefault("ms_p10_p90", (times[5], times[45]))
    info["ms"] = sum(medians) / len(medians)
    info["ms_each"] = medians
    snapshot, tokens = positions[-1]

    def iteration():  # the flushing iteration (the last of the cycle), from its own state
        cache.copy_(snapshot)
        g(tokens)

    info["iteration"] = iteration
    return info


SPIN_CYCLES = 200_000
"""GPU cycles (~0.1 ms) of the spin queued before each timed call's start event: longer than the
host takes to submit the call, so the interval holds GPU work only (with an idle GPU before the
start event the AR step read 15-50 us more than 100 back-to-back replays; with the spin, within
5 us of them)."""


def restored_call_times(restore, call, iters: int) -> list[float]:
    """Sorted ms of call() by CUDA events around it alone, after restore() each time (in stream
    order the start event follows the restore): subtracting a separately measured median restore
    time instead added up to ~10% of noise. A GPU spin between the restore and the start event
    keeps the GPU busy while the host submits the call (see SPIN_CYCLES): the time measured is
    the call's GPU time, as the copy that sets the weight-read floor is measured."""
    times = []
    for _ in range(iters):
        restore()
        torch.cuda._sleep(SPIN_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--trees", default="3,2,1;3,4,2,1", help="tree configurations separated by ';'")
    ap.add_argument("--skip-reference", action="store_true", help="skip the slow reference-backend rows")
    ap.add_argument("--skip-stream-layers", action="store_true",
                    help="skip the AR row of the one-launch layer stack (ops/stream_layers; its first build takes ~1 min)")
    ap.add_argument("--skip-unfolded", action="store_true",
                    help="time only the model with its norm weights folded (models/fold.py), not also the original")
    ap.add_argument("--pending", type=int, default=None,
                    help="pending input slots of the tree iterations' caches (models/cache.py; 0: none); default: "
                         f"as the product, {PENDING_SLOTS} for trees up to {PENDING_MAX_NODES} nodes, else none")
    ap.add_argument("--profile", action="store_true",
                    help="print per-kernel device time of the graphs (after all timings: the profiler slows later replays)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # The Triton rows run with the one-launch kernels off; their rows turn them on ("on": as the
    # default mode, but a failed build raises instead of falling back).
    with paths.use_backend("triton"), paths.use_stream_layers("off"):
        return run(args)


def run(args) -> int:
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    print(dev, torch.__version__, gpu_state(), flush=True)
    RESULTS["device"] = dev

    bw = copy_bandwidth()
    t0 = time.time()
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda")
    nbytes = param_bytes(model)
    floor_ms = nbytes / bw * 1000
    RESULTS.update(preset=args.preset, param_bytes=nbytes, copy_bw_TBps=bw / 1e12, floor_ms=floor_ms)
    print(f"{args.preset}: {nbytes / 1e9:.2f} GB of bf16 weights (built in {time.time() - t0:.0f}s); "
          f"copy {bw / 1e12:.2f} TB/s -> floor {floor_ms:.3f} ms", flush=True)
    # The same weights with the norm weights folded into the projections (the fused-norm kernel
    # path): a copy, so both variants are timed in this process.
    variants = {"folded": copy.deepcopy(model).fold_norm_weights_()}
    if not args.skip_unfolded:
        variants["unfolded"] = model
    else:
        del model

    vocab = variants["folded"].config.vocab_size
    prompt = torch.randint(0, vocab, (1, 32), device="cuda")
    ids = torch.randint(0, vocab, (1, 1), device="cuda")
    rows = []

    def record(name, ms, **extra):
        rows.append({"what": name, "ms": ms, **extra})
        print(f"  {name:<56} {ms:8.3f} ms", flush=True)

    def step_graph_ms(m, warm_s: float = 0.0):
        cache = prefilled_cache(m, prompt, 256)
        graph = StepGraph(m, cache)
        if warm_s:  # replays until the GPU has left its idle clocks, from the prefilled state each
            snapshot = cache.clone()  # time (each replay advances the cache; attention caches are bounded)
            start = time.time()
            while time.time() - start < warm_s:
                for _ in range(50):
                    graph(ids)
                cache.copy_(snapshot)
                torch.cuda.synchronize()
        return median_ms(lambda: graph(ids), iters=100), graph

    step_logits = {}
    ar_stream_ms = None  # the one-launch AR step (ops/stream_layers), when timed
    to_profile = []  # (fn, label) profiled once every row is timed
    if not args.skip_reference:
        with paths.use_backend("reference"):
            m = variants.get("unfolded", variants["folded"])
            ms, graph = step_graph_ms(m)
            record("AR step CUDA graph [reference ops]", ms)
            cache = prefilled_cache(m, prompt, 256)
            step_logits["reference"] = StepGraph(m, cache)(ids).clone()
            del graph, cache
    ar_ms = None
    for name, m in variants.items():
        cache = prefilled_cache(m, prompt, 256)
        step_logits[name] = StepGraph(m, cache)(ids).clone()
        del cache
        # The first row timed after the model build ran ~1% slow (the same AR step read
        # 2.405-2.426 ms first, 2.363-2.376 ms as a later row): 3 s of replays first.
        ms, graph = step_graph_ms(m, warm_s=3.0 if ar_ms is None else 0.0)
        ar_ms = ar_ms or ms
        record(f"AR step CUDA graph [{name}]", ms)
        if args.profile:  # profiled after every timing: torch.profiler slows later graph replays
            to_profile.append((lambda graph=graph: graph(ids), f"AR step graph [{name}]"))
        graph = None  # free its buffers before the next capture (a profiled one is kept until the end)
        if name == "folded":
            reason = stream_layers.unsupported_reason(m, 1, torch.device("cuda"))
            if args.skip_stream_layers or reason is not None:
                print(f"  (one-launch layer stack not timed: {reason or '--skip-stream-layers'})")
            else:  # ops/stream_layers: every layer in one persistent launch (the default mode's step)
                with paths.use_stream_layers("on"):
                    ar_stream_ms = step_graph_ms(m)[0]
                    record("AR step CUDA graph [folded, one-launch layer stack]", ar_stream_ms)
                    print(f"    {gpu_state()}", flush=True)
                    cache = prefilled_cache(m, prompt, 256)
                    a, b = step_logits[name].double(), StepGraph(m, cache)(ids).double()
                    del cache
                RESULTS["step_logits_rel_err_stream_layers"] = rel = ((a - b).norm() / a.norm()).item()
                print(f"  step logits [one-launch layer stack] vs [folded]: rel err {rel:.2e}, same argmax "
                      f"{bool((a.argmax(-1) == b.argmax(-1)).all())}", flush=True)
    base = step_logits.get("reference", step_logits.get("unfolded"))
    for name in variants:
        if base is not None and base is not step_logits[name]:
            a, b = base.double(), step_logits[name].double()
            rel = ((a - b).norm() / a.norm()).item()
            same = bool((a.argmax(-1) == b.argmax(-1)).all())
            RESULTS[f"step_logits_rel_err_{name}"] = rel
            print(f"  step logits [{name}] vs {'reference' if 'reference' in step_logits else 'unfolded'}: "
                  f"rel err {rel:.2e}, same argmax {same}")

    tree_rows = []
    default_mode = {}  # nodes -> the default mode's tree iteration (folded model)
    for spec in args.trees.split(";"):
        tree = Tree.from_config(tuple(int(v) for v in spec.split(",")))
        pending = args.pending if args.pending is not None else pending_slots_for(tree, variants.get("folded"))
        for name, m in variants.items():
            info = time_tree_iteration(m, prompt, tree, vocab, pending)
            record(f"verify+accept+replay graph [{tree.num_nodes} nodes, {name}]", info["ms"], ratio_to_ar=info["ms"] / ar_ms)
            if len(info["ms_each"]) > 1:
                print(f"    mean over a cycle of {len(info['ms_each'])} iterations of {pending} pending slots: "
                      + ", ".join(f"{t:.3f}" for t in info["ms_each"]) + " ms (the last flushes)", flush=True)
                record(f"  flushing iteration only [{tree.num_nodes} nodes, {name}]", info["ms_each"][-1])
            if args.profile and name == "folded":
                to_profile.append((info["iteration"], f"tree iteration [{tree.num_nodes} nodes, {name}] (+ cache restore copy)"))
            if name == "folded":
                other = 0 if pending else PENDING_SLOTS
                record(f"  same, {other or 'no'} pending slots [{tree.num_nodes} nodes, {name}]",
                       time_tree_iteration(m, prompt, tree, vocab, other)["ms"])
                stream_reason = stream_proj.unsupported_reason(m, tree.num_nodes, torch.device("cuda"))
                if not args.skip_stream_layers and stream_reason is None:
                    # the default mode's verify: projections on the weight stream (ops/stream_proj)
                    with paths.use_stream_layers("on"):
                        info_s = time_tree_iteration(m, prompt, tree, vocab, pending)
                    record(f"  same, projections on the weight stream (default mode) "
                           f"[{tree.num_nodes} nodes, {name}]", info_s["ms"])
                    print(f"    {gpu_state()}", flush=True)
                    default_mode[tree.num_nodes] = info_s
                    if ar_stream_ms:
                        RESULTS[f"stream_mode_ratio_{tree.num_nodes}"] = info_s["ms"] / ar_stream_ms
                        print(f"    = {info_s['ms'] / ar_stream_ms:.3f}x the one-launch AR step ({ar_stream_ms:.3f} ms); "
                              f"accepted {info_s['accepted']}/{tree.max_depth}; produced == step-graph greedy chain: "
                              f"{info_s['greedy_chain_matches']}", flush=True)
                elif not args.skip_stream_layers:  # the default mode's verify is this row's Triton one
                    print(f"    (weight-stream projections not timed: {stream_reason})")
                    default_mode[tree.num_nodes] = info
            tree_rows.append({"tree": spec, "nodes": tree.num_nodes, "variant": name, "ms": info["ms"],
                              "ratio": info["ms"] / ar_ms, "accepted": info["accepted"],
                              "greedy_chain_matches": info["greedy_chain_matches"],
                              "cache_advanced": info["cache_advanced"], "ms_p10_p90": info["ms_p10_p90"]})
            print(f"    accepted {info['accepted']}/{tree.max_depth} drafted tokens; produced == step-graph greedy chain: "
                  f"{info['greedy_chain_matches']}; cache advanced by {info['cache_advanced']}; "
                  f"p10-p90 {info['ms_p10_p90'][0]:.3f}-{info['ms_p10_p90'][1]:.3f} ms", flush=True)
    RESULTS["rows"] = rows
    RESULTS["trees"] = tree_rows
    for fn, label in to_profile:
        RESULTS.setdefault("profiles", []).append(profile_top(fn, label))

    try:
        import mamba_ssm  # noqa: F401

        RESULTS["mamba_ssm"] = "importable: bench/bench_mamba_ssm.py times it against ours"
    except ImportError:
        RESULTS["mamba_ssm"] = "not importable here: bench/bench_mamba_ssm.py times it from a carried copy"

    print(f"\n{dev}; {args.preset} random bf16 weights, fp32 states, batch 1; x AR = over the folded AR step")
    print(f"weight-read floor {floor_ms:.3f} ms ({nbytes / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s)")
    print(f"{'what':<58} {'ms':>8} {'x floor':>8} {'x AR':>6}")
    for r in rows:
        print(f"{r['what']:<58} {r['ms']:8.3f} {r['ms'] / floor_ms:8.2f} {r['ms'] / ar_ms:6.2f}")
    print(f"mamba_ssm: {RESULTS['mamba_ssm']}")
    if ar_stream_ms:  # what a user gets without setting SSMSPEC_STREAM_LAYERS
        print(f"\nthe default mode (one-launch CUDA kernels where they run): AR step {ar_stream_ms:.3f} ms "
              f"= {ar_stream_ms / floor_ms:.3f}x the floor")
        RESULTS["default_mode"] = {"ar_ms": ar_stream_ms, "ar_x_floor": ar_stream_ms / floor_ms, "trees": {}}
        for nodes, info in default_mode.items():
            ratio = info["ms"] / ar_stream_ms
            RESULTS["default_mode"]["trees"][nodes] = {"ms": info["ms"], "x_ar": ratio}
            print(f"  {nodes:>3}-node tree iteration {info['ms']:.3f} ms = {ratio:.3f}x the AR step; accepted "
                  f"{info['accepted']}; produced == step-graph greedy chain: {info['greedy_chain_matches']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(RESULTS, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
