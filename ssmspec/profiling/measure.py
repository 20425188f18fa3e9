"""run_profile: time target (and drafter) calls against input size and assemble profile.json's dict.

What is measured (`run_profile`)
--------------------------------
For each input size N (packed tokens of one target call) and method:

- ``stree``: one ``verify`` on a packed tree of N nodes, then ``replay`` of a root-to-leaf path
  of the tree's full depth (every drafted level accepted: the most replay work a step can do).
  The tree is the near-balanced BFS fan-out tree `balanced_tree(N, fanout)`: node i's parent
  is (i - 1) // fanout, so with the default fan-out 2 it is the complete binary tree with N
  nodes (15 / 31 / 63 nodes = the full binary trees of the STree paper's figure 3).
- ``unrolled``: the same tree unrolled into its root-to-leaf paths, one batch row per leaf,
  each row a chain ``verify`` of depth + 1 tokens (shorter paths padded to the longest, as a
  batched implementation must) followed by a ``replay`` of every row's own path.
- ``chain``: a chain of N nodes (``Tree.chain(N - 1)``), verified and replayed in full.

Size 1 is the autoregressive step (``model.step`` on one token per row) for every method.
The caches are prefilled with a random prompt (default 128 tokens). Before each timed call
only the cache's per-row length is reset: that keeps attention writing into the same slots and
the SSM state's shape fixed, so calls do not accumulate, without timing a full cache copy that
decoding never pays. (The SSM state's values drift from call to call; the cost does not depend
on them.) On CUDA the call is captured into a CUDA graph when it allows it (no host syncs);
otherwise, or when capture fails, it runs eagerly; each record says which mode was used.

Drafter: the greedy draft as the decode loop runs it (decoding/drafters.py FusedGreedyDraft, one
sequence): its fixed part (``step_root``: commit gather + root step), one level (``draft_level``:
top-k, parents' states gathered, a step at the level's width) at each width of `level_widths`,
and ``run`` whole for each configuration, beside the sum of parts the cost model uses for it. Each
is captured into a CUDA graph on CUDA, as the loop's iteration is. Then the loop's per-iteration
overhead: a real greedy `generate` per iteration minus the same iteration replayed back to back
(`_measure_loop`; on the CPU both run eagerly and the difference is the loop's Python and
read-back). A decoding step is then predicted as target fit(N) + root + levels + overhead
(tuning/static.py CostModel). On the CPU, `generate` runs this fused loop only with graphs on
(its default there is the eager ModelDrafter loop, one drafter level fewer): CPU predictions
describe the fused loop. The drafter and the loop are timed for one sequence, as the decoder runs
them, whatever ``batch`` is.

On the CPU the calls run on `ProfileSettings.threads` threads (default 1, or OMP_NUM_THREADS when
set: see `timing.default_cpu_threads`), and the count used is recorded. Measurements whose repeated
timings disagree, and primary fits that do not explain the medians, are reported as warnings:
logged on the ``ssmspec.profiling`` logger and listed under the profile's ``warnings``.
"""
from __future__ import annotations

import datetime as _dt
import logging
import platform
import time

import torch

from ..errors import InputError
from .fits import Fit, by_width, compute_break_even, compute_fits, fit_warnings
from .schema import SCHEMA_NAME, SCHEMA_VERSION, architecture_of, config_summary, dtype_name, model_fingerprint
from .settings import ProfileSettings, ProgressFn
from .timing import Timing, cpu_threads, default_cpu_threads, samples_disagree, time_call

log = logging.getLogger("ssmspec.profiling")


@torch.inference_mode()
def run_profile(
    target,
    *,
    settings: ProfileSettings | None = None,
    drafter=None,
    source: str = "",
    drafter_source: str = "",
    progress: ProgressFn | None = None,
) -> dict:
    """Measure `target` (and `drafter`) as described in the module docstring; return profile.json's dict.

    Like decoding's Engine it takes charge of the models: where the kernels fuse the norms, it
    folds their norm weights into their projections in place first (models/fold.py), to time
    the path that an Engine runs.

    Args:
        target: a LanguageModel on its device and dtype, in eval mode.
        settings: what to measure; defaults to ProfileSettings().
        drafter: an optional LanguageModel sharing the target's vocabulary.
        source, drafter_source: where the models came from (a directory or preset name).
        progress: progress(label, done, total) callback.
    Returns:
        profile.json's dict (see `ssmspec.profiling.schema`); its ``warnings`` are also logged on
        the ``ssmspec.profiling`` logger.
    """
    s = settings or ProfileSettings()
    s.validate()
    started = time.perf_counter()
    device = target.device
    from ..models.fold import fold_for_kernels

    fold_for_kernels(target, drafter)  # in place, as an Engine prepares them: time the path it runs
    if drafter is not None and drafter.config.vocab_size != target.config.vocab_size:
        raise InputError(
            f"drafter vocabulary ({drafter.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}); profile a drafter made for this target"
        )
    if drafter is not None:  # before timing, not at the config's draft: a node has at most vocab_size children
        from ssmspec.trees import Tree

        from ..limits import check_tree_width

        for cfg in s.configs:
            check_tree_width(Tree.from_config(cfg), drafter.config.vocab_size)
    early = s.warnings(with_drafter=drafter is not None)
    for w in early:  # before timing: a run that lacks what the user wanted can be stopped now
        log.warning(w)
    with cpu_threads(timing_threads(s, device)):
        threads_used = torch.get_num_threads()
        device_info = _device_info(device)
        timings, drafter_timings = _measure(target, drafter, s, device, progress)
    arch = architecture_of(target)
    fits = compute_fits(timings, arch)
    late = timing_warnings(timings, drafter_timings) + fit_warnings(fits, timings)
    for w in late:
        log.warning(w)
    warnings = early + late
    return {
        "schema": SCHEMA_NAME,
        "version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_info,
        "dtype": dtype_name(target.dtype),
        "target": _describe(target, source),
        "drafter": None if drafter is None else _describe(drafter, drafter_source),
        "settings": {"sizes": list(s.sizes), "methods": list(s.methods), "batch": s.batch,
                     "prompt_len": s.prompt_len, "warmup": s.warmup, "repeats": s.repeats,
                     "fanout": s.fanout, "cuda_graphs": s.cuda_graphs and device.type == "cuda",
                     "threads": threads_used, "reference_n": s.reference_n,
                     "configs": [list(c) for c in s.configs], "backend": _backend_report(device)},
        "timings": timings,
        "fits": fits,
        "break_even": compute_break_even(fits, timings, s.reference_n),
        "drafter_timings": drafter_timings,
        "warnings": warnings,
        "elapsed_s": time.perf_counter() - started,
    }


def _measure(target, drafter, s: ProfileSettings, device, progress: ProgressFn | None):
    """The target's timings per method, and the drafter's (None without a drafter)."""
    total = count_items(s, drafter is not None)
    done = [0]
    timings = _measure_target(target, s, device, progress, total, done)
    drafter_timings = None
    if drafter is not None:
        target_step_ms = next((r["median"] for m in s.methods for r in timings[m] if r["size"] == 1), None)
        if target_step_ms is None:  # size 1 not asked for: time the AR step now, it anchors lambda_gamma
            timer = _Timer(target, s, device, s.prompt_len + 8)
            target_step_ms = time_call(timer.step_fn(), warmup=s.warmup, repeats=s.repeats, device=device,
                                       cuda_graph=s.cuda_graphs and device.type == "cuda").median
        # predicted verify times of the drafter's trees come from the target's stree fit
        fits = compute_fits(timings, architecture_of(target))
        m0 = "stree" if "stree" in fits else next(iter(fits))
        fit_for = Fit.from_dict(fits[m0]["primary"], fits[m0][fits[m0]["primary"]])
        drafter_timings = _measure_drafter(drafter, target, target_step_ms, s, device, fit_for, progress, total, done)
    if progress:
        progress("done", total, total)
    return timings, drafter_timings


def _describe(model, source: str) -> dict:
    """profile.json's description of a model: its fingerprint, where it came from, its shape."""
    return {"fingerprint": model_fingerprint(model), "source": source, "architecture": architecture_of(model),
            "config": config_summary(model)}


def count_items(settings: ProfileSettings, with_drafter: bool) -> int:
    """How many timed items `run_profile` reports progress over."""
    n = len(settings.sizes) * len(settings.methods)
    if with_drafter:  # the root step, a level per width, each config's draft, the decode loop
        n += 1 + len(level_widths(settings)) + len(settings.configs) + 1
    return n


def timing_warnings(timings: dict, drafter_timings: dict | None) -> list[str]:
    """One sentence naming every measurement whose repeated timings disagree (see `samples_disagree`)."""
    noisy = []
    for method, rows in timings.items():
        noisy += [(f"{method} N={r['size']}", r) for r in rows]
    if drafter_timings is not None:
        noisy += [("drafter root step", drafter_timings["root"])]
        noisy += [(f"drafter level width {r['width']}", r) for r in drafter_timings["levels"]]
        noisy += [(f"drafting {','.join(map(str, c['config']))}", c["draft"]) for c in drafter_timings["configs"]]
        loop = drafter_timings["iteration"]["loop"]
        noisy += [("decode loop", loop)] if loop is not None else []
    noisy = [(label, r) for label, r in noisy if samples_disagree(r["samples"])]
    if not noisy:
        return []
    worst = max(r["max"] / r["min"] if r["min"] > 0 else float("inf") for _, r in noisy)
    names = ", ".join(label for label, _ in noisy[:6]) + (f" and {len(noisy) - 6} more" if len(noisy) > 6 else "")
    return [
        f"repeated timings disagree for {names} (max/min up to {worst:.3g}x): the machine is busy or the calls "
        "are too short to time; close other work, keep OMP_NUM_THREADS=1 on a shared CPU, or raise --repeats"
    ]


def balanced_tree(n: int, fanout: int = 2):
    """The near-balanced tree of n nodes in BFS order: parent(i) = (i - 1) // fanout."""
    from ssmspec.trees import Tree

    return Tree.from_parents([-1] + [(i - 1) // fanout for i in range(1, n)])


def _root_to_leaf_paths(tree) -> list[list[int]]:
    return [tree.path(leaf) for leaf in tree.leaves()]


class _Timer:
    """Closures over one model and its prefilled cache that `time_call` can repeat."""

    def __init__(self, model, settings: ProfileSettings, device: torch.device, max_len: int):
        self.model, self.s, self.device = model, settings, device
        gen = torch.Generator(device="cpu").manual_seed(settings.seed)
        vocab = model.config.vocab_size
        self.prompt = torch.randint(0, vocab, (settings.batch, settings.prompt_len), generator=gen).to(device)
        self.base = model.new_cache(settings.batch, max_len)
        model(self.prompt, self.base, last_only=True)
        self.vocab = vocab
        self.gen = gen

    def tokens(self, rows: int, n: int) -> torch.Tensor:
        return torch.randint(0, self.vocab, (rows, n), generator=self.gen).to(self.device)

    def cache_rows(self, per_row: int):
        """The prefilled cache with each of its B rows repeated per_row times (row-major)."""
        rows = torch.arange(self.s.batch, device=self.device).repeat_interleave(per_row)
        return self.base.select(rows)

    def step_fn(self, model=None, cache=None):
        model = model or self.model
        cache = cache if cache is not None else self.base.clone()
        seqlen0 = cache.seqlen.clone()
        ids = self.tokens(cache.batch_size, 1)

        def fn():
            cache.seqlen.copy_(seqlen0)
            return model.step(ids, cache)

        return fn

    def tree_fn(self, tree, rows_per_seq: int, paths: list[list[int]]):
        """verify on `tree` for B*rows_per_seq rows, then replay `paths` (one per row in a sequence)."""
        cache = self.cache_rows(rows_per_seq)
        rows = cache.batch_size
        seqlen0 = cache.seqlen.clone()
        ids = self.tokens(rows, tree.num_nodes)
        width = max(len(p) for p in paths)
        path = torch.tensor([p + [0] * (width - len(p)) for p in paths] * self.s.batch, device=self.device)
        path_len = torch.tensor([len(p) for p in paths] * self.s.batch, device=self.device)
        tree.parents_tensor(self.device), tree.depth_tensor(self.device), tree.mask_tensor(self.device)

        def fn():
            cache.seqlen.copy_(seqlen0)
            _, acts = self.model.verify(ids, tree, cache)
            self.model.replay(cache, acts, path, path_len)

        return fn


def _measure_target(model, settings: ProfileSettings, device, progress: ProgressFn | None, total: int, done: list):
    s = settings
    timer = _Timer(model, s, device, s.prompt_len + max(s.sizes) + 8)
    use_graph = s.cuda_graphs and device.type == "cuda"
    timings: dict[str, list[dict]] = {m: [] for m in s.methods}
    step_record = None
    for n in s.sizes:
        for method in s.methods:
            if progress:
                progress(f"{method} N={n}", done[0], total)
            if n == 1:  # the AR step is the same call for every method: time it once
                if step_record is None:
                    t = time_call(timer.step_fn(), warmup=s.warmup, repeats=s.repeats, device=device, cuda_graph=use_graph)
                    step_record = {"size": 1, "call": "step", "rows": s.batch, "tokens": s.batch,
                                   "tree": {"nodes": 1, "depth": 0, "leaves": 1}, **t.to_dict()}
                timings[method].append(dict(step_record))
            else:
                fn, shape = _tree_call(timer, method, n, s.fanout)
                t = time_call(fn, warmup=s.warmup, repeats=s.repeats, device=device, cuda_graph=use_graph)
                del fn
                timings[method].append({"size": n, "call": "verify+replay", **shape, **t.to_dict()})
            done[0] += 1
    return timings


def _tree_call(timer: _Timer, method: str, n: int, fanout: int):
    """The repeatable verify+replay call of `method` at size n >= 2, and its record's shape fields."""
    from ssmspec.trees import Tree

    batch = timer.s.batch
    if method == "chain":
        tree = Tree.chain(n - 1)
        fn = timer.tree_fn(tree, 1, [list(range(n))])
        return fn, {"rows": batch, "tokens": batch * n,
                    "tree": {"nodes": tree.num_nodes, "depth": tree.max_depth, "leaves": 1}}
    tree = balanced_tree(n, fanout)
    paths = _root_to_leaf_paths(tree)
    leaves = len(paths)
    shape = {"nodes": n, "depth": tree.max_depth, "leaves": leaves}
    if method == "stree":
        fn = timer.tree_fn(tree, 1, [max(paths, key=len)])  # replay the deepest path: the most work
        return fn, {"rows": batch, "tokens": batch * n, "tree": shape}
    depth = tree.max_depth
    # unrolled: each row is its own chain; replay indexes that chain's nodes 0..len-1
    fn = timer.tree_fn(Tree.chain(depth), leaves, [list(range(len(p))) for p in paths])
    return fn, {"rows": batch * leaves, "tokens": batch * leaves * (depth + 1), "tree": shape}


LOOP_TREE = (1,)
"""The tree of the decode loops timed for the per-iteration overhead: the smallest, as the
overhead (read-back, Python bookkeeping) does not depend on the tree."""
LOOP_TOKENS = 32
"""Tokens generated per timed decode loop (about one iteration each with untrained models)."""


def level_widths(settings: ProfileSettings) -> list[int]:
    """Widths at which one drafter level is timed: powers of two up to the largest target call
    (the largest tree tune-tree ranks from this profile) and every level width of the configs."""
    from ssmspec.trees import Tree

    top = max(settings.sizes)
    widths = {1} | {2 ** k for k in range(top.bit_length()) if 2 ** k <= top}
    widths |= {w for c in settings.configs for w in Tree.from_config(c).level_widths()[1:]}
    return sorted(widths)


def level_probe(width: int, vocab_size: int):
    """The probe tree on which a drafter level of `width` nodes is timed, and that level's index
    (FusedGreedyDraft.draft_level): `width` parents with one child each. It is (width, 1) where
    the root can have `width` distinct children; a wider level (a small vocabulary: a node has at
    most vocab_size distinct children, and more was an IndexError in the top-k) hangs below as
    few levels as reach it, each at most vocab_size times wider than the one above."""
    from ssmspec.trees import Tree

    widths = [1, min(vocab_size, width)]  # the root's, then each level's down to `width` nodes
    while widths[-1] < width:
        widths.append(min(widths[-1] * vocab_size, width))
    parents, start = [-1], 0  # start: the first node of the level above
    for above, level in zip(widths, widths[1:]):
        parents += [start + j // vocab_size for j in range(level)]  # at most vocab_size children each
        start += above
    parents += [start + j for j in range(width)]  # the timed level: one child per node of the last
    return Tree.from_parents(parents), len(widths) - 1


def _measure_drafter(drafter, target, target_step_ms: float, settings: ProfileSettings, device, fit_for,
                     progress: ProgressFn | None, total: int, done: list) -> dict:
    """The fused greedy draft (decoding/drafters.py FusedGreedyDraft), timed in the parts the cost
    model composes, then whole for each config, then the decode loop's per-iteration overhead.

    A fused draft of a tree = `step_root` (commit gather + root step) + one `draft_level` per depth
    (top-k over the parents' logits, gather of the parents' states, a step at the level's width W),
    the deepest level included. A level is timed at each width W of `level_widths` on the probe
    tree (W, 1), whose second level has W nodes below W parents: its top-k reads W rows, as many
    as or more than a level of W nodes reads in any tree (W / k parents), so that term is an upper
    bound (the top-k's cost grows little with the rows at these widths).
    """
    from dataclasses import replace

    from ssmspec.trees import Tree

    from ..decoding.drafters import ModelDrafter

    s = settings
    use_graph = s.cuda_graphs and device.type == "cuda"
    # The decode loop drafts one sequence; every call below grows the drafter's length by at most
    # one token (2 * warmup + repeats + a few calls per timing), which the capacity covers.
    dtimer = _Timer(drafter, replace(s, batch=1), device, s.prompt_len + 3 * (s.warmup + s.repeats) + 16)

    def fused(tree):
        md = ModelDrafter(drafter, sample_children=False, graphs=False)
        md.start_from(dtimer.base.clone())
        draft = md.fused_draft(tree)
        draft.start(int(dtimer.prompt[0, -1]))
        return draft

    def timed(label, fn):
        if progress:
            progress(label, done[0], total)
        t = time_call(fn, warmup=s.warmup, repeats=s.repeats, device=device, cuda_graph=use_graph)
        done[0] += 1
        return t

    root = timed("drafter root step", fused(Tree.from_config((1,))).step_root)
    levels = []
    for w in level_widths(s):
        shape, timed_level = level_probe(w, drafter.config.vocab_size)
        probe = fused(shape)
        # The levels above: the (W, V) logits and states of the timed level's parents, as in decoding.
        logits = probe.step_root()
        for i in range(timed_level):
            logits = probe.draft_level(i, logits)
        t = timed(f"drafter level width {w}",
                  lambda probe=probe, logits=logits, i=timed_level: probe.draft_level(i, logits))
        levels.append({"width": w, "parent_width": w, "children": 1, **t.to_dict()})
    widths, level_ms = [r["width"] for r in levels], [r["median"] for r in levels]

    def composed(tree) -> float:
        return root.median + sum(by_width(widths, level_ms, w) for w in tree.level_widths()[1:])

    configs = []
    for cfg in s.configs:
        tree = Tree.from_config(cfg)
        t = timed(f"drafting {','.join(map(str, cfg))}", fused(tree).run)
        verify_ms = float(fit_for(tree.num_nodes)) if fit_for is not None else None
        configs.append({
            "config": list(cfg), "nodes": tree.num_nodes, "widths": tree.level_widths()[1:],
            "draft": t.to_dict(), "composed_ms": composed(tree), "predicted_verify_ms": verify_ms,
            "extrapolated": tree.num_nodes > max(s.sizes),  # the fit is used past the measured sizes
            "lambda_gamma": (t.median / tree.max_depth) / target_step_ms,
        })
    loop = _measure_loop(target, drafter, s, device, use_graph, progress, total, done)
    loop["predicted_bare_ms"] = (float(fit_for(Tree.from_config(LOOP_TREE).num_nodes)) + composed(Tree.from_config(LOOP_TREE))
                                 if fit_for is not None else None)
    for c in configs:
        c["predicted_step_ms"] = (None if c["predicted_verify_ms"] is None
                                  else c["predicted_verify_ms"] + c["composed_ms"] + loop["overhead_ms"])
    return {"impl": "FusedGreedyDraft: the greedy decode loop's device-side draft", "target_step_ms": target_step_ms,
            "root": root.to_dict(), "levels": levels, "configs": configs, "iteration": loop,
            "iteration_overhead_ms": loop["overhead_ms"], "lambda_gamma": level_ms[0] / target_step_ms}


def _measure_loop(target, drafter, s: ProfileSettings, device, use_graph: bool, progress, total: int,
                  done: list) -> dict:
    """The decode loop's per-iteration cost outside its iteration's device work.

    `Engine.generate` (greedy, graphs on: the fused loop of decoding/generate.py; on the CPU the same
    iteration runs eagerly) on tree LOOP_TREE, per iteration: its decode time over its target
    calls, which holds the iteration's replay, the read-back of the produced tokens that waits for
    it, and the loop's Python. Then the same iteration (SpeculativeIterationGraph on the same tree,
    target cache and drafter) called back to back, as `time_call` times graphs: its device time
    alone. The difference is the overhead a speculative iteration pays on top of its device work:
    a real `generate` per-token time is used rather than AR's (whose step graph, read-back and
    loop differ) because this is the loop the speculative predictions describe.
    """
    from ssmspec.trees import Tree

    from ..decoding.drafters import ModelDrafter
    from ..decoding.engine import Engine
    from ..decoding.generate import GenerationConfig, pending_slots_for
    from ..decoding.graphs import SpeculativeIterationGraph

    from ..ops import dispatch

    tree = Tree.from_config(LOOP_TREE)
    if device.type == "cuda" and dispatch.get_backend() == "reference":
        done[0] += 1
        return {"tree": list(LOOP_TREE), "loop": None, "bare": None, "overhead_ms": 0.0,
                "note": "not measured: the reference backend has no captured decode loop on CUDA"}
    gen = torch.Generator(device="cpu").manual_seed(s.seed + 1)
    prompt = torch.randint(0, target.config.vocab_size, (1, s.prompt_len), generator=gen)
    if progress:
        progress("decode loop overhead", done[0], total)
    config = GenerationConfig(method="stree", tree=tree, max_new_tokens=LOOP_TOKENS, graphs=True)
    engine = Engine(target, ModelDrafter(drafter))
    per_iteration = []
    for i in range(1 + s.repeats):  # the first builds and captures the loop's graphs: untimed
        st = engine.generate(prompt, config).stats
        if i:
            per_iteration.append(1e3 * (st["elapsed_s"] - st["prefill_s"]) / max(st["target_calls"], 1))
    loop = Timing(per_iteration)

    # The bare iteration, on its own caches: room for every timed call to accept the whole tree.
    max_len = s.prompt_len + (tree.max_depth + 1) * (3 * (s.warmup + s.repeats) + 8)
    cache = target.new_cache(1, max_len, pending=pending_slots_for(tree, target))
    prompt = prompt.to(device)
    target(prompt, cache, last_only=True)
    drafter_bare = ModelDrafter(drafter, graphs=False)
    drafter_bare.begin(prompt, max_len)
    draft = drafter_bare.fused_draft(tree)
    draft.start(int(prompt[0, -1]))
    iteration = SpeculativeIterationGraph(target, cache, draft, capture=use_graph)
    bare = time_call(iteration, warmup=s.warmup, repeats=s.repeats, device=device)
    done[0] += 1
    return {"tree": list(LOOP_TREE), "loop": loop.to_dict(), "bare": {**bare.to_dict(), "mode": "cuda_graph" if use_graph else "eager"},
            "overhead_ms": max(loop.median - bare.median, 0.0)}


def timing_threads(settings: ProfileSettings, device: torch.device) -> int | None:
    """CPU threads `run_profile` times on (None on a GPU: torch's count is left as it is)."""
    return (settings.threads or default_cpu_threads()) if device.type == "cpu" else None


def device_name(device: torch.device, threads: int | None = None) -> str:
    """The GPU's name, or the CPU's with the thread count timing runs on (default: torch's current one)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine() or "cpu"
    n = torch.get_num_threads() if threads is None else threads
    return f"CPU ({cpu}, {n} thread{'' if n == 1 else 's'})"


def _device_info(device: torch.device) -> dict:
    return {"type": device.type, "name": device_name(device), "torch": torch.__version__, "cuda": torch.version.cuda}


def _backend_report(device: torch.device) -> dict:
    from ..ops import dispatch

    out = {"backend": dispatch.get_backend()}
    for op in sorted(dispatch._REFERENCE):
        impl = dispatch.resolve(op, device)
        out[op] = "reference" if impl.__module__.endswith(".naive") else impl.__module__
    return out
