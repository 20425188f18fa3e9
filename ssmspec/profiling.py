"""Runtime profiling of target and drafter calls against input size, cost-model fits, profile.json.

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

Drafter: one ``step`` at each batch width that a tree configuration needs (its
``Tree.level_widths()`` except the last level, which is never fed to the drafter), on a cache
branched with ``ModelCache.select``, and the total drafting time of each configuration
(``ModelDrafter.draft`` when available, greedy; else a step loop with ``select``).

Cost models (STree paper, section 4): t = k*N + C (linear, pure SSM targets) and
t = a*N^2 + b*N + c (quadratic, hybrids with attention), least squares on the medians of the
verify calls (N >= 2; the AR step is a separate code path and is reported beside them). Both are
reported with R^2 and residuals; `primary` names the one that matches the architecture. A tree
of N2 nodes beats the reference call of N1 nodes when tau2 / tau1 >= t(N2) / t(N1), with tau
the mean accepted tokens per target call; the break-even table gives that ratio over the
measured range, the reference being the ``chain`` method at N1 (vanilla speculative decoding,
as in the paper's figure 2c) when chain was measured, else the same method.

profile.json, schema version 1 (all times in milliseconds)
----------------------------------------------------------
::

    {
      "schema": "ssmspec.profile", "version": 1,
      "created": ISO-8601 UTC time,
      "device": {"type": "cuda"|"cpu", "name": str, "torch": str, "cuda": str|null},
      "dtype": "fp32"|"bf16"|"fp16",
      "target": {"fingerprint": hex str (see model_fingerprint), "source": str, "architecture": "ssm"|"hybrid",
                 "config": {"d_model", "vocab_size", "n_layers", "layer_counts": {kind: n},
                            "num_parameters", "mamba": {...}|null, "attention": {...}|null}},
      "drafter": null | same shape as "target",
      "settings": {"sizes": [int], "methods": [str], "batch": int, "prompt_len": int,
                   "warmup": int, "repeats": int, "fanout": int, "cuda_graphs": bool,
                   "reference_n": int, "configs": [[int]],
                   "backend": {"backend": auto|reference|triton, op: "reference"|kernel module}},
      "timings": {method: [{"size": N, "call": "step"|"verify+replay", "rows": int,
                            "tokens": int, "tree": {"nodes", "depth", "leaves"},
                            "mode": "eager"|"cuda_graph", "note": str|null,
                            "median", "min", "max", "q1", "q3", "iqr", "samples": [float]}]},
      "fits": {method: {"primary": "linear"|"quadratic", "sizes": [N fitted],
                        "linear": {"coef": {"k", "C"}, "r2", "residuals": [float]},
                        "quadratic": {"coef": {"a", "b", "c"}, "r2", "residuals": [float]}}},
      "break_even": {"reference_n": N1, "reference_method": str, "reference_ms": float,
                     "table": {method: [{"n": N2, "ratio": t(N2)/t_ref(N1) | null,
                                         "ratio_vs_ar": t(N2)/t_AR | null}]}},
                     (null where a fit predicts a non-positive time: too noisy to use)
      "drafter_timings": null | {"impl": str, "target_step_ms": float,
                                 "steps": [{"width": w, ...timing fields}],
                                 "configs": [{"config": [int], "nodes": int, "widths": [int],
                                              "steps_ms_sum": sum of the step medians at widths,
                                              "draft": {...timing}, "predicted_verify_ms",
                                              "predicted_step_ms", "extrapolated": bool,
                                              "lambda_gamma"}],
                                 "lambda_gamma": T_draft(width 1) / T_target(size 1)},
      "elapsed_s": seconds the whole measurement took (optional)
    }

Fits use the verify calls only (sizes >= 2, when there are at least three; see `fitted_sizes`):
the size-1 autoregressive step is another code path. Residuals are measured minus fitted
medians, in the order of the fit's sizes. ``lambda_gamma``
is the mamba-drafters paper's bandit weight (its A.4): the drafter's per-token time over the
target's autoregressive step time. The target fingerprint hashes the architecture (config and
parameter shapes), not the weights, because runtime depends only on the former.
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from .errors import InputError, ProfileMismatchError
from .ops import graph_tables

SCHEMA_NAME = "ssmspec.profile"
SCHEMA_VERSION = 1
METHODS = ("stree", "unrolled", "chain")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CONFIGS = ((3, 2, 2, 1), (3, 3, 2, 1), (3, 2, 2, 1, 1), (2, 2, 2, 1, 1, 1))
"""Tree configurations timed for the drafter by default (the mamba-drafters paper's table 6)."""

ProgressFn = Callable[[str, int, int], None]
"""progress(label, done, total): called before each timed item and once at the end."""


# ----------------------------------------------------------------------------------------------
# Settings: the one home of every default (the CLI reads its defaults from here).
# ----------------------------------------------------------------------------------------------
@dataclass
class ProfileSettings:
    """What `run_profile` measures and how."""

    sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    """Input sizes N (packed tokens per target call); 1 is the autoregressive step."""
    methods: tuple[str, ...] = METHODS
    """Any of stree, unrolled, chain."""
    batch: int = 1
    """Independent sequences per call (rows of the cache)."""
    repeats: int = 10
    """Timed calls per measurement (the median is reported)."""
    warmup: int = 3
    """Untimed calls before each measurement."""
    prompt_len: int = 128
    """Tokens prefilled into the cache before timing."""
    fanout: int = 2
    """Children per node of the balanced tree used for stree and unrolled."""
    cuda_graphs: bool = True
    """Capture each timed call into a CUDA graph when on CUDA and the call allows it."""
    reference_n: int = 5
    """N1 of the break-even ratio t(N2) / t(N1) (5, as in the STree paper)."""
    configs: tuple[tuple[int, ...], ...] = DEFAULT_CONFIGS
    """Tree configurations whose drafting time is measured (needs a drafter)."""
    seed: int = 0

    def validate(self) -> None:
        if not self.sizes:
            raise InputError("--sizes needs at least one size, e.g. 1,2,4,8")
        bad = [n for n in self.sizes if not isinstance(n, int) or n < 1]
        if bad:
            raise InputError(f"sizes must be positive integers, got {bad}")
        if not self.methods:
            raise InputError(f"--methods needs at least one of {', '.join(METHODS)}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise InputError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
        for name in ("batch", "repeats", "prompt_len", "reference_n"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise InputError(f"warmup must be >= 0, got {self.warmup}")
        if self.fanout < 1:
            raise InputError(f"fanout must be >= 1, got {self.fanout}")
        for cfg in self.configs:
            if not cfg or any(n < 1 for n in cfg):
                raise InputError(f"tree configuration {cfg} must be a non-empty list of positive integers")


def parse_sizes(text: str) -> tuple[int, ...]:
    """`1,2,4,8` -> (1, 2, 4, 8), sorted and deduplicated; clear errors on anything else."""
    try:
        sizes = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise InputError(f"--sizes must be comma-separated positive integers such as 1,2,4,8, got {text!r}") from None
    if not sizes or any(n < 1 for n in sizes):
        raise InputError(f"--sizes must be comma-separated positive integers such as 1,2,4,8, got {text!r}")
    return tuple(sorted(set(sizes)))


def parse_methods(text: str) -> tuple[str, ...]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if not methods or unknown:
        raise InputError(f"--methods must list some of {', '.join(METHODS)}, got {text!r}")
    return tuple(dict.fromkeys(methods))


def parse_configs(text: str) -> tuple[tuple[int, ...], ...]:
    """`3,2,1;4,2,1,1` -> ((3, 2, 1), (4, 2, 1, 1))."""
    out = []
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        try:
            cfg = tuple(int(t) for t in part.split(","))
        except ValueError:
            raise InputError(f"--configs must look like 3,2,1;4,2,1,1, got {text!r}") from None
        if any(n < 1 for n in cfg):
            raise InputError(f"every level of a tree configuration must be >= 1, got {part!r}")
        out.append(cfg)
    if not out:
        raise InputError(f"--configs must look like 3,2,1;4,2,1,1, got {text!r}")
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Timing harness (shared with the GPU benchmarks)
# ----------------------------------------------------------------------------------------------
@dataclass
class Timing:
    """Wall time of one callable in milliseconds: summary statistics and every sample."""

    samples: list[float]
    mode: str = "eager"
    """eager, or cuda_graph when the call was captured and replayed as one graph."""
    note: str | None = None
    """Why a requested CUDA graph was not used, when it was not."""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def q1(self) -> float:
        return float(np.percentile(self.samples, 25))

    @property
    def q3(self) -> float:
        return float(np.percentile(self.samples, 75))

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "note": self.note, "median": self.median, "min": self.min, "max": self.max,
            "q1": self.q1, "q3": self.q3, "iqr": self.iqr, "samples": list(self.samples),
        }


def _capture(fn: Callable[[], object], device: torch.device):
    """A CUDA graph of fn, or (None, reason) when fn cannot be captured (e.g. it syncs with the host).

    A failed capture leaves torch on the capture stream; the caller's stream is restored here.
    """
    graph = torch.cuda.CUDAGraph()
    caller = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(caller)
    try:
        with torch.cuda.stream(side):
            fn()  # allocations on the capture stream before capture, as torch recommends
        caller.wait_stream(side)
        with graph_tables.written_after_capture(owner=graph), torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 -- any capture failure falls back to eager timing
        torch.cuda.set_stream(caller)
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001 -- an invalidated capture may report once more here
            pass
        return None, f"capture failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:160]}"
    return graph, None


def time_call(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 10,
    device: str | torch.device = "cpu",
    cuda_graph: bool = False,
) -> Timing:
    """Time fn() `repeats` times after `warmup` untimed calls.

    On CUDA each call is bracketed by CUDA events (no host sync between calls, one
    `torch.cuda.synchronize` at the end), and with `cuda_graph` the call is captured into a CUDA
    graph and replayed, falling back to eager (with `Timing.note` saying why) when capture is
    impossible. On the CPU each call is timed with `time.perf_counter`.

    fn must be repeatable: each call must do the same work (reset what it advances).
    """
    if repeats < 1:
        raise InputError(f"repeats must be >= 1, got {repeats}")
    device = torch.device(device)
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return Timing(samples)

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    run, mode, note, graph = fn, "eager", None, None
    if cuda_graph:
        graph, note = _capture(fn, device)
        if graph is not None:
            run, mode = graph.replay, "cuda_graph"
            for _ in range(warmup):
                run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for s, e in zip(starts, ends):
        s.record()
        run()
        e.record()
    torch.cuda.synchronize(device)
    samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    del graph  # frees the graph's private memory pool
    return Timing(samples, mode, note)


# ----------------------------------------------------------------------------------------------
# Fits and break-even
# ----------------------------------------------------------------------------------------------
@dataclass
class Fit:
    """A polynomial cost model t(N) fitted by least squares."""

    kind: str
    """linear (t = k*N + C) or quadratic (t = a*N^2 + b*N + c)."""
    coef: dict[str, float]
    r2: float
    residuals: list[float]
    """measured - fitted, in the order of the sizes given."""

    def __call__(self, n):
        n = np.asarray(n, dtype=float)
        if self.kind == "linear":
            return self.coef["k"] * n + self.coef["C"]
        return self.coef["a"] * n**2 + self.coef["b"] * n + self.coef["c"]

    def to_dict(self) -> dict:
        return {"coef": dict(self.coef), "r2": self.r2, "residuals": list(self.residuals)}

    @classmethod
    def from_dict(cls, kind: str, d: dict) -> "Fit":
        return cls(kind, {k: float(v) for k, v in d["coef"].items()}, float(d["r2"]), [float(r) for r in d["residuals"]])


def r_squared(y: np.ndarray, fitted: np.ndarray) -> float:
    """1 - SS_res / SS_tot; 1.0 for a perfect fit of constant data, 0.0 for an imperfect one."""
    y, fitted = np.asarray(y, float), np.asarray(fitted, float)
    ss_res = float(((y - fitted) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if ss_tot == 0.0:
        return 1.0 if ss_res <= 1e-24 * max(1.0, float((y**2).sum())) else 0.0
    return 1.0 - ss_res / ss_tot


def fit_cost_model(sizes: Sequence[float], times: Sequence[float], kind: str) -> Fit:
    """Least-squares fit of t = k*N + C (`linear`) or t = a*N^2 + b*N + c (`quadratic`).

    With fewer distinct sizes than coefficients the system is underdetermined; numpy's lstsq
    then returns the minimum-norm solution, and R^2 is still reported.
    """
    n = np.asarray(sizes, dtype=float)
    t = np.asarray(times, dtype=float)
    if n.shape != t.shape or n.ndim != 1 or n.size == 0:
        raise InputError("fit needs equally long, non-empty lists of sizes and times")
    if kind == "linear":
        design, names = np.stack([n, np.ones_like(n)], axis=1), ("k", "C")
    elif kind == "quadratic":
        design, names = np.stack([n**2, n, np.ones_like(n)], axis=1), ("a", "b", "c")
    else:
        raise InputError(f"unknown fit kind {kind!r}; use linear or quadratic")
    coef, *_ = np.linalg.lstsq(design, t, rcond=None)
    fitted = design @ coef
    return Fit(kind, {k: float(v) for k, v in zip(names, coef)}, r_squared(t, fitted), [float(r) for r in t - fitted])


def primary_fit_kind(architecture: str) -> str:
    """The STree paper's choice: linear for pure SSMs, quadratic once attention is present."""
    return "quadratic" if architecture == "hybrid" else "linear"


def break_even_ratio(fit2: Fit, n2, fit1: Fit, n1: float):
    """tau2 / tau1 that a call of n2 tokens needs to beat one of n1 tokens: t2(n2) / t1(n1)."""
    return fit2(n2) / float(fit1(n1))


# ----------------------------------------------------------------------------------------------
# Model identity
# ----------------------------------------------------------------------------------------------
def model_fingerprint(model) -> str:
    """A hash of the architecture: the config and every parameter's name and shape, not the values.

    Delegates to `ssmspec.models.loading.model_fingerprint` (which also hashes parameter dtypes)
    so that every command names a model the same way; the local fallback hashes the config and
    shapes only. Weights are left out on purpose: runtime does not depend on their values.
    """
    try:
        from .models.loading import model_fingerprint as shared  # the loader's, when it has one
    except ImportError:
        shared = None
    if shared is not None and shared is not model_fingerprint:
        return shared(model)
    payload = {
        "config": model.config.to_dict(),
        "params": [[name, list(p.shape)] for name, p in model.named_parameters()],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def architecture_of(model) -> str:
    return "hybrid" if "attention" in model.config.layers else "ssm"


def config_summary(model) -> dict:
    cfg = model.config
    kinds = {k: cfg.layers.count(k) for k in ("mamba", "attention", "mlp") if k in cfg.layers}
    summary = {
        "d_model": cfg.d_model, "vocab_size": cfg.vocab_size, "n_layers": len(cfg.layers),
        "layer_counts": kinds, "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "mamba": None, "attention": None,
    }
    if "mamba" in kinds:
        m = cfg.mamba
        summary["mamba"] = {"n_heads": m.n_heads, "head_dim": m.head_dim, "d_state": m.d_state,
                            "n_groups": m.n_groups, "conv_kernel": m.conv_kernel}
    if "attention" in kinds:
        a = cfg.attention
        summary["attention"] = {"n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads, "head_dim": a.head_dim}
    return summary


def dtype_name(dtype: torch.dtype) -> str:
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise InputError(f"unsupported dtype {dtype}; use one of {', '.join(DTYPES)}")


# ----------------------------------------------------------------------------------------------
# Trees used for timing
# ----------------------------------------------------------------------------------------------
def balanced_tree(n: int, fanout: int = 2):
    """The near-balanced tree of n nodes in BFS order: parent(i) = (i - 1) // fanout."""
    from ssmspec.trees import Tree

    return Tree.from_parents([-1] + [(i - 1) // fanout for i in range(1, n)])


def _root_to_leaf_paths(tree) -> list[list[int]]:
    return [tree.path(leaf) for leaf in tree.leaves()]


# ----------------------------------------------------------------------------------------------
# Measurement
# ----------------------------------------------------------------------------------------------
def _backend_report(device: torch.device) -> dict:
    from .ops import dispatch

    out = {"backend": dispatch.get_backend()}
    for op in sorted(dispatch._REFERENCE):
        impl = dispatch.resolve(op, device)
        out[op] = "reference" if impl.__module__.endswith(".naive") else impl.__module__
    return out


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
    from ssmspec.trees import Tree

    s = settings
    max_depth_needed = max(s.sizes)
    timer = _Timer(model, s, device, s.prompt_len + max_depth_needed + 8)
    use_graph = s.cuda_graphs and device.type == "cuda"
    timings: dict[str, list[dict]] = {m: [] for m in s.methods}
    step_record = None
    for n in s.sizes:
        for method in s.methods:
            if progress:
                progress(f"{method} N={n}", done[0], total)
            if n == 1:
                if step_record is None:
                    t = time_call(timer.step_fn(), warmup=s.warmup, repeats=s.repeats, device=device, cuda_graph=use_graph)
                    step_record = {"size": 1, "call": "step", "rows": s.batch, "tokens": s.batch,
                                   "tree": {"nodes": 1, "depth": 0, "leaves": 1}, **t.to_dict()}
                timings[method].append(dict(step_record))
                done[0] += 1
                continue
            if method == "chain":
                tree = Tree.chain(n - 1)
                fn = timer.tree_fn(tree, 1, [list(range(n))])
                rows, tokens, leaves = s.batch, s.batch * n, 1
            else:
                tree = balanced_tree(n, s.fanout)
                paths = _root_to_leaf_paths(tree)
                leaves = len(paths)
                if method == "stree":
                    deepest = max(paths, key=len)
                    fn = timer.tree_fn(tree, 1, [deepest])
                    rows, tokens = s.batch, s.batch * n
                else:
                    depth = tree.max_depth
                    # each row is its own chain: replay indexes that chain's nodes 0..len-1
                    fn = timer.tree_fn(Tree.chain(depth), leaves, [list(range(len(p))) for p in paths])
                    rows, tokens = s.batch * leaves, s.batch * leaves * (depth + 1)
            t = time_call(fn, warmup=s.warmup, repeats=s.repeats, device=device, cuda_graph=use_graph)
            del fn
            timings[method].append({"size": n, "call": "verify+replay", "rows": rows, "tokens": tokens,
                                    "tree": {"nodes": tree.num_nodes if method != "unrolled" else n,
                                             "depth": tree.max_depth, "leaves": leaves},
                                    **t.to_dict()})
            done[0] += 1
    return timings


def _measure_drafter(drafter, target_step_ms: float, settings: ProfileSettings, device, fit_for,
                     progress: ProgressFn | None, total: int, done: list) -> dict:
    from ssmspec.trees import Tree

    s = settings
    trees = [Tree.from_config(cfg) for cfg in s.configs]
    widths = sorted({w for t in trees for w in t.level_widths()[:-1]} | {1})
    max_depth = max(t.max_depth for t in trees)
    dtimer = _Timer(drafter, s, device, s.prompt_len + max_depth + 8)
    use_graph = s.cuda_graphs and device.type == "cuda"
    steps = []
    for w in widths:
        if progress:
            progress(f"drafter step width {w}", done[0], total)
        cache = dtimer.cache_rows(w)
        t = time_call(dtimer.step_fn(drafter, cache), warmup=s.warmup, repeats=s.repeats, device=device,
                      cuda_graph=use_graph)
        steps.append({"width": w, **t.to_dict()})
        done[0] += 1
    step_ms = {d["width"]: d["median"] for d in steps}

    impl, make_draft = _draft_closure(drafter, s, dtimer, device)
    configs = []
    for cfg, tree in zip(s.configs, trees):
        if progress:
            progress(f"drafting {','.join(map(str, cfg))}", done[0], total)
        t = time_call(make_draft(tree), warmup=s.warmup, repeats=s.repeats, device=device)
        gamma = tree.max_depth
        verify_ms = float(fit_for(tree.num_nodes)) if fit_for is not None else None
        configs.append({
            "config": list(cfg), "nodes": tree.num_nodes, "widths": tree.level_widths()[:-1],
            "steps_ms_sum": sum(step_ms[w] for w in tree.level_widths()[:-1]),
            "draft": t.to_dict(), "predicted_verify_ms": verify_ms,
            "predicted_step_ms": None if verify_ms is None else verify_ms + t.median,
            "extrapolated": tree.num_nodes > max(s.sizes),  # the fit is used past the measured sizes
            "lambda_gamma": (t.median / gamma) / target_step_ms,
        })
        done[0] += 1
    return {"impl": impl, "target_step_ms": target_step_ms, "steps": steps, "configs": configs,
            "lambda_gamma": step_ms[1] / target_step_ms}


def _draft_closure(drafter, s: ProfileSettings, dtimer: _Timer, device):
    """The drafting call per tree: the decoder's ModelDrafter when present, else a step loop."""
    try:
        from .decoding.drafters import ModelDrafter
        from .decoding.sampling import SamplingParams
    except ImportError:
        ModelDrafter = None
    if ModelDrafter is not None and s.batch == 1:
        md = ModelDrafter(drafter, sample_children=False)
        md.start_from(dtimer.base.clone())
        seqlen0 = md.cache.seqlen.clone()
        params = SamplingParams()
        root = int(dtimer.prompt[0, -1])

        def make(tree):
            def fn():
                md.cache.seqlen.copy_(seqlen0)  # draft feeds the root: undo that advance
                md.pending = []
                return md.draft(root, tree, params, None)
            return fn

        return "ModelDrafter.draft (greedy)", make

    def make(tree):
        widths = tree.level_widths()[:-1]
        cfg = tree.config

        def fn():
            cache = dtimer.base.clone()
            logits = drafter.step(dtimer.prompt[:, -1:], cache)[:, -1]
            for d, w in enumerate(widths[1:]):
                k = cfg[d]
                top = torch.topk(logits, k, dim=-1).indices  # (rows, k)
                rows = torch.arange(logits.shape[0], device=device).repeat_interleave(k)
                cache = cache.select(rows)
                logits = drafter.step(top.reshape(-1, 1), cache)[:, -1]
            return logits
        return fn

    return "step loop with cache.select (top-k)", make


def _device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        import platform

        name = platform.processor() or platform.machine() or "cpu"
        name = f"CPU ({name}, {torch.get_num_threads()} threads)"
    return {"type": device.type, "name": name, "torch": torch.__version__, "cuda": torch.version.cuda}


def count_items(settings: ProfileSettings, with_drafter: bool) -> int:
    from ssmspec.trees import Tree

    n = len(settings.sizes) * len(settings.methods)
    if with_drafter:
        trees = [Tree.from_config(c) for c in settings.configs]
        widths = {w for t in trees for w in t.level_widths()[:-1]} | {1}
        n += len(widths) + len(trees)
    return n


def fitted_sizes(sizes: Sequence[int]) -> list[int]:
    """The sizes a cost model is fitted on: the verify calls (N >= 2) when there are three or more.

    Size 1 is the autoregressive step, a different code path (`model.step`, a fused single-token
    update) that on a GPU costs about half of the smallest verify call; fitting it together with
    the verify calls would bend both models. It stays in the timings, the plot and the
    break-even table's `ratio_vs_ar`.
    """
    verify = [n for n in sizes if n >= 2]
    return verify if len(verify) >= 3 else list(sizes)


def compute_fits(timings: dict, architecture: str) -> dict:
    """Both cost models per method, on `fitted_sizes`, with the architecture's primary named."""
    fits = {}
    for method, rows in timings.items():
        used = fitted_sizes([r["size"] for r in rows])
        med = [r["median"] for r in rows if r["size"] in used]
        fits[method] = {"primary": primary_fit_kind(architecture), "sizes": used,
                        "linear": fit_cost_model(used, med, "linear").to_dict(),
                        "quadratic": fit_cost_model(used, med, "quadratic").to_dict()}
    return fits


def compute_break_even(fits: dict, timings: dict, reference_n: int) -> dict:
    """tau2/tau1 >= t(N2)/t_ref(N1) over each method's fitted range, and t(N2)/t_AR.

    The reference is the chain method at N1 (vanilla speculative decoding) when measured, else
    each method at N1. `ratio_vs_ar` is the mean accepted tokens per call a tree of N2 nodes
    needs just to match plain autoregressive decoding (whose tau is 1), drafting not counted.
    """
    ref_method = "chain" if "chain" in fits else None
    table = {}
    ref_ms_out = None
    for method, f in fits.items():
        rm = ref_method or method
        ref_fit = Fit.from_dict(fits[rm]["primary"], fits[rm][fits[rm]["primary"]])
        fit = Fit.from_dict(f["primary"], f[f["primary"]])
        used = f.get("sizes") or [r["size"] for r in timings[method]]
        ar = next((r["median"] for r in timings[method] if r["size"] == 1), None)
        ref_ms = float(ref_fit(reference_n))
        if rm == ref_method or ref_method is None:
            ref_ms_out = ref_ms
        rows = []
        for n2 in range(min(used), max(used) + 1):
            t2 = float(fit(n2))
            # A fit that predicts a non-positive time (noisy data, few sizes) gives no usable ratio.
            ok = t2 > 0 and ref_ms > 0
            rows.append({"n": n2, "ratio": t2 / ref_ms if ok else None,
                         "ratio_vs_ar": t2 / ar if ok and ar is not None and ar > 0 else None})
        table[method] = rows
    return {"reference_n": reference_n, "reference_method": ref_method or "same",
            "reference_ms": ref_ms_out, "table": table}


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

    Args:
        target: a LanguageModel on its device and dtype, in eval mode.
        settings: what to measure; defaults to ProfileSettings().
        drafter: an optional LanguageModel sharing the target's vocabulary.
        source, drafter_source: where the models came from (a directory or preset name).
        progress: progress(label, done, total) callback.
    """
    s = settings or ProfileSettings()
    s.validate()
    started = time.perf_counter()
    device = target.device
    from .models.fold import fold_for_kernels

    fold_for_kernels(target, drafter)  # time the path that generate runs (see decoding/generate.py)
    if drafter is not None and drafter.config.vocab_size != target.config.vocab_size:
        raise InputError(
            f"drafter vocabulary ({drafter.config.vocab_size}) differs from the target's "
            f"({target.config.vocab_size}); profile a drafter made for this target"
        )
    total = count_items(s, drafter is not None)
    done = [0]
    timings = _measure_target(target, s, device, progress, total, done)
    arch = architecture_of(target)
    fits = compute_fits(timings, arch)
    break_even = compute_break_even(fits, timings, s.reference_n)

    drafter_timings = None
    if drafter is not None:
        target_step_ms = next((r["median"] for m in s.methods for r in timings[m] if r["size"] == 1), None)
        if target_step_ms is None:  # size 1 not asked for: time the AR step now, it anchors lambda_gamma
            timer = _Timer(target, s, device, s.prompt_len + 8)
            target_step_ms = time_call(timer.step_fn(), warmup=s.warmup, repeats=s.repeats, device=device,
                                       cuda_graph=s.cuda_graphs and device.type == "cuda").median
        m0 = "stree" if "stree" in fits else next(iter(fits))
        fit_for = Fit.from_dict(fits[m0]["primary"], fits[m0][fits[m0]["primary"]])
        drafter_timings = _measure_drafter(drafter, target_step_ms, s, device, fit_for, progress, total, done)
    if progress:
        progress("done", total, total)

    return {
        "schema": SCHEMA_NAME,
        "version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": _device_info(device),
        "dtype": dtype_name(target.dtype),
        "target": {"fingerprint": model_fingerprint(target), "source": source, "architecture": arch,
                   "config": config_summary(target)},
        "drafter": None if drafter is None else {
            "fingerprint": model_fingerprint(drafter), "source": drafter_source,
            "architecture": architecture_of(drafter), "config": config_summary(drafter)},
        "settings": {"sizes": list(s.sizes), "methods": list(s.methods), "batch": s.batch,
                     "prompt_len": s.prompt_len, "warmup": s.warmup, "repeats": s.repeats,
                     "fanout": s.fanout, "cuda_graphs": s.cuda_graphs, "reference_n": s.reference_n,
                     "configs": [list(c) for c in s.configs], "backend": _backend_report(device)},
        "timings": timings,
        "fits": fits,
        "break_even": break_even,
        "drafter_timings": drafter_timings,
        "elapsed_s": time.perf_counter() - started,
    }


# ----------------------------------------------------------------------------------------------
# profile.json: save, load (validated), check against a model
# ----------------------------------------------------------------------------------------------
@dataclass
class Profile:
    """A loaded profile.json; `data` is the validated dict, unchanged (so it round-trips)."""

    data: dict = field(repr=False)

    @property
    def fingerprint(self) -> str:
        return self.data["target"]["fingerprint"]

    @property
    def dtype(self) -> str:
        return self.data["dtype"]

    @property
    def device_name(self) -> str:
        return self.data["device"]["name"]

    def fit(self, method: str = "stree", kind: str | None = None) -> Fit:
        """The fitted cost model of `method` (its primary kind unless `kind` is given)."""
        if method not in self.data["fits"]:
            raise InputError(f"profile has no fits for method {method!r}; it has {', '.join(self.data['fits'])}")
        f = self.data["fits"][method]
        kind = kind or f["primary"]
        return Fit.from_dict(kind, f[kind])

    def target_ms(self, n, method: str = "stree"):
        """Predicted time of one target call on n packed tokens, in ms."""
        return self.fit(method)(n)

    @property
    def ar_step_ms(self) -> float | None:
        for rows in self.data["timings"].values():
            for r in rows:
                if r["size"] == 1:
                    return r["median"]
        return None

    @property
    def lambda_gamma(self) -> float | None:
        """T_draft / T_target for the bandit reward, or None without drafter timings."""
        d = self.data.get("drafter_timings")
        return None if d is None else d["lambda_gamma"]

    def to_dict(self) -> dict:
        return self.data


def save_profile(profile: dict | Profile, path: str | Path) -> Path:
    data = profile.data if isinstance(profile, Profile) else profile
    validate_profile(data)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _require(d: dict, keys: Sequence[str], where: str) -> None:
    if not isinstance(d, dict):
        raise InputError(f"profile.json: {where} must be an object")
    missing = [k for k in keys if k not in d]
    if missing:
        raise InputError(f"profile.json: {where} lacks {', '.join(missing)}; re-run `ssmspec profile`")


def validate_profile(d: dict) -> None:
    """Raise InputError unless d follows the schema described in this module's docstring."""
    _require(d, ["schema", "version"], "the top level")
    if d["schema"] != SCHEMA_NAME:
        raise InputError(f"not an ssmspec profile (schema {d['schema']!r}); write one with `ssmspec profile`")
    if d["version"] != SCHEMA_VERSION:
        raise InputError(
            f"profile.json schema version {d['version']} is not supported (this ssmspec reads {SCHEMA_VERSION}); "
            "re-run `ssmspec profile`"
        )
    _require(d, ["created", "device", "dtype", "target", "settings", "timings", "fits", "break_even",
                 "drafter_timings"], "the top level")
    _require(d["device"], ["type", "name"], "device")
    if d["dtype"] not in DTYPES:
        raise InputError(f"profile.json: dtype {d['dtype']!r} is not one of {', '.join(DTYPES)}")
    _require(d["target"], ["fingerprint", "architecture", "config"], "target")
    for method, rows in d["timings"].items():
        if method not in METHODS:
            raise InputError(f"profile.json: unknown method {method!r} in timings")
        if not isinstance(rows, list) or not rows:
            raise InputError(f"profile.json: timings of {method} must be a non-empty list")
        for r in rows:
            _require(r, ["size", "median", "samples"], f"a timing of {method}")
            if not (isinstance(r["median"], (int, float)) and math.isfinite(r["median"])):
                raise InputError(f"profile.json: a timing of {method} has a non-numeric median")
    for method, f in d["fits"].items():
        _require(f, ["primary", "linear", "quadratic"], f"fits of {method}")
        if f["primary"] not in ("linear", "quadratic"):
            raise InputError(f"profile.json: fits of {method} name an unknown primary {f['primary']!r}")
        for kind in ("linear", "quadratic"):
            _require(f[kind], ["coef", "r2", "residuals"], f"the {kind} fit of {method}")
    _require(d["break_even"], ["reference_n", "reference_method", "table"], "break_even")
    if d["drafter_timings"] is not None:
        _require(d["drafter_timings"], ["steps", "configs", "lambda_gamma", "target_step_ms"], "drafter_timings")


def load_profile(path: str | Path) -> Profile:
    """Read and validate profile.json; raises InputError with what to do when it is unusable."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"profile file {path} does not exist; write one with `ssmspec profile --out {path}`")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise InputError(f"profile file {path} is not valid JSON: {e}") from None
    validate_profile(data)
    return Profile(data)


def check_profile_matches(profile: Profile | dict, model, dtype: torch.dtype | str, force: bool = False) -> list[str]:
    """Refuse a profile measured on another architecture or dtype (ProfileMismatchError).

    With force=True the mismatches are returned as warning sentences instead. Returns [] when
    the profile matches.
    """
    data = profile.data if isinstance(profile, Profile) else profile
    want_dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
    problems = []
    fp = model_fingerprint(model)
    if data["target"]["fingerprint"] != fp:
        src = data["target"].get("source") or "another model"
        problems.append(
            f"the profile was measured on {src} (fingerprint {data['target']['fingerprint'][:12]}), "
            f"not on this target (fingerprint {fp[:12]})"
        )
    if data["dtype"] != want_dtype:
        problems.append(f"the profile was measured in {data['dtype']}, this run uses {want_dtype}")
    if problems and not force:
        raise ProfileMismatchError(
            "; ".join(problems) + ". Run `ssmspec profile` for this model and dtype, or pass --force to use it anyway."
        )
    return problems


# ----------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------
_COLORS = {"stree": "tab:blue", "unrolled": "tab:orange", "chain": "tab:green"}


def plot_profile(profile: dict | Profile, path: str | Path, title: str | None = None) -> Path:
    """PNG: measured medians with IQR bars and fitted curves (left), break-even ratio (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 -- for the plain-number log axis

    d = profile.data if isinstance(profile, Profile) else profile
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    ar_drawn = False
    for method, rows in d["timings"].items():
        color = _COLORS.get(method)
        f = d["fits"][method]
        used = set(f.get("sizes") or [r["size"] for r in rows])
        pts = [r for r in rows if r["size"] in used]
        n = np.array([r["size"] for r in pts], float)
        med = np.array([r["median"] for r in pts])
        lo = med - np.array([r.get("q1", r["median"]) for r in pts])
        hi = np.array([r.get("q3", r["median"]) for r in pts]) - med
        ax.errorbar(n, med, yerr=[np.maximum(lo, 0), np.maximum(hi, 0)], fmt="o", color=color, capsize=3,
                    ms=4, label=f"{method} verify+replay (median, IQR)")
        grid = np.linspace(n.min(), n.max(), 200)
        for kind, style in (("linear", "-"), ("quadratic", ":")):
            fit = Fit.from_dict(kind, f[kind])
            primary = kind == f["primary"]
            ax.plot(grid, fit(grid), style, color=color, alpha=0.9 if primary else 0.5, lw=1.6 if primary else 1.0,
                    label=f"{method} {_fit_label(fit)}" + (" *" if primary else ""))
        ar = [r for r in rows if r["size"] == 1 and r["size"] not in used]
        if ar and not ar_drawn:
            ax.plot([1], [ar[0]["median"]], "k*", ms=11, label=f"AR step (model.step): {ar[0]['median']:.3g} ms")
            ar_drawn = True
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("input size N (tree nodes; chain: tokens)")
    ax.set_ylabel("time per call (ms)")
    ax.set_title("target call time; fits on verify calls, * = primary")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")

    be = d["break_even"]
    for method, rows in be["table"].items():
        nan = float("nan")  # unusable ratios (None) leave gaps
        ax2.plot([r["n"] for r in rows], [nan if r["ratio"] is None else r["ratio"] for r in rows],
                 color=_COLORS.get(method), label=f"{method} vs {be['reference_method']} at N1")
        if any(r.get("ratio_vs_ar") is not None for r in rows):
            ax2.plot([r["n"] for r in rows], [nan if r.get("ratio_vs_ar") is None else r["ratio_vs_ar"] for r in rows],
                     "--", lw=1.0, alpha=0.6, color=_COLORS.get(method), label=f"{method} vs AR step")
    ax2.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax2.axvline(be["reference_n"], color="grey", lw=0.8, ls=":")
    ref = be["reference_method"]
    ax2.set_xlabel("tree size N2 (nodes)")
    ax2.set_ylabel(f"required tau2 / tau1 (solid: vs {ref} at N1 = {be['reference_n']})")
    ax2.set_title("break-even acceptance ratio t(N2) / t(N1)")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize=8)

    t = d["target"]
    src = t.get("source") or t["config"].get("d_model")
    fig.suptitle(title or f"ssmspec profile: {src} ({t['architecture']}, {d['dtype']}, batch "
                 f"{d['settings']['batch']}) on {d['device']['name']}", fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _fit_label(fit: Fit) -> str:
    c = fit.coef
    if fit.kind == "linear":
        return f"{c['k']:.3g}N {c['C']:+.3g} (R²={fit.r2:.3f})"
    return f"{c['a']:.2g}N² {c['b']:+.3g}N {c['c']:+.3g} (R²={fit.r2:.3f})"
