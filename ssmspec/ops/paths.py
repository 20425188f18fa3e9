"""The one place that decides which code runs: the plain-torch reference, the Triton kernels, or
the one-launch CUDA kernels, per op and per model shape, and says why (`explain`).

Settings (ops/settings.py) come from the environment, read once, and from scopes:

- the backend: `SSMSPEC_BACKEND` (auto, the default; reference; triton), `set_backend` (the
  CLI's --backend, for the process) or `use_backend(name)` (a `with` block). "auto" runs a
  Triton kernel for tensors on a CUDA device where the kernel imports, else the reference;
  "triton" runs the kernels on any device (on the CPU under TRITON_INTERPRET=1) and fails when
  one is missing; "reference" never runs a kernel.
- the one-launch CUDA kernels (ops/stream_layers, the batch-1 decode step's layer stack in one
  launch; ops/stream_proj, a verify's projections of up to 16 tree nodes): `SSMSPEC_STREAM_LAYERS`
  or `use_stream_layers(mode)`: auto (unset, the default: used wherever they can run, else the
  Triton kernels without a word), 1 / on (as auto, but say why when they cannot run, and fail
  when they do not build) or 0 / off (the Triton kernels only).
- TRITON_INTERPRET=1: the Triton kernels run on CPU tensors (Triton's interpreter; the tests).

Models ask here (`kernel`, `fused_layers`, `splits_in_proj`, `OneLaunchRunners`); the kernel
modules state their own limits (`unsupported_reason`, the GEMM's row counts) and only this
module reads them to choose. A one-launch kernel that fails to build warns once in the default
mode and the model keeps the Triton kernels; with SSMSPEC_STREAM_LAYERS=1 it raises.
"""
from __future__ import annotations

import functools
import importlib
import sys
import warnings
from typing import Callable

import torch

from ..errors import CodePathError
from .settings import (  # noqa: F401  (the settings, re-exported: models and the CLI ask here)
    BACKEND_ENV,
    BACKENDS,
    STREAM_LAYERS_ENV,
    Settings,
    environment,
    get_backend,
    interpreting,
    read_settings,
    set_backend,
    settings,
    stream_layers_mode,
    use_backend,
    use_stream_layers,
)


# --- per op: the reference or the Triton kernel ---------------------------------------------------

TRITON_KERNELS = {
    "tree_scan": ("ssmspec.ops.tree_scan.triton", "tree_scan"),
    "tree_scan_gated": ("ssmspec.ops.tree_scan.triton", "tree_scan_gated"),
    "tree_conv": ("ssmspec.ops.tree_conv.triton", "tree_conv"),
    "replay_states": ("ssmspec.ops.state_replay.triton", "replay_states"),
    "replay_states_layers": ("ssmspec.ops.state_replay.triton", "replay_states_layers"),
    "settle_pending_layers": ("ssmspec.ops.state_replay.triton", "settle_pending_layers"),
    "advance_positions": ("ssmspec.ops.state_replay.triton", "advance_positions"),
    "chunk_scan_forward": ("ssmspec.ops.chunk_scan.triton", "chunk_scan_forward"),
    "causal_conv": ("ssmspec.ops.causal_conv.triton", "causal_conv"),
    "causal_conv_train": ("ssmspec.ops.causal_conv.triton", "causal_conv_train"),
    "mamba_step": ("ssmspec.ops.step_update.triton", "mamba_step"),
    "mamba_step_out": ("ssmspec.ops.step_update.triton", "mamba_step_out"),
    "rms_norm": ("ssmspec.ops.triton_common", "rms_norm"),
    "add_rms_norm": ("ssmspec.ops.step_update.triton", "add_rms_norm"),
    "gated_rms_norm": ("ssmspec.ops.step_update.triton", "gated_rms_norm"),
    "time_step": ("ssmspec.ops.step_update.triton", "time_step"),
    "linear": ("ssmspec.ops.gemv.triton", "linear"),
    "norm_linear": ("ssmspec.ops.gemv.triton", "norm_linear"),
    "greedy_accept": ("ssmspec.ops.greedy_accept.triton", "greedy_accept"),
    "ranked_tokens": ("ssmspec.ops.ranked_tokens.triton", "ranked_tokens"),
    "race_tokens": ("ssmspec.ops.ranked_tokens.triton", "race_tokens"),
    "sampled_accept": ("ssmspec.ops.sampled_accept.triton", "sampled_accept"),
    "token_losses": ("ssmspec.ops.token_loss.triton", "token_losses"),
}
"""op -> (module, function) of its Triton kernel; the ops not listed (chunk_scan) have none."""


@functools.cache
def _import_kernel(op: str) -> tuple[Callable | None, str | None]:
    """(the Triton kernel of `op`, None) or (None, why it is not there). Cached: `kernel` runs
    for every op of every layer of every decode step."""
    spec = TRITON_KERNELS.get(op)
    if spec is None:
        return None, "no Triton kernel"
    try:
        return getattr(importlib.import_module(spec[0]), spec[1]), None
    except (ImportError, AttributeError) as e:
        return None, f"the Triton kernel does not import ({type(e).__name__}: {e})"


def _assume_constant_result(fn: Callable) -> Callable:
    """torch.compiler.assume_constant_result's mark, set without importing torch._dynamo: that
    import costs 1.3 s at every command's start (most never compile); Dynamo reads the mark when
    it traces a caller, loaded by then. tests/test_ops_paths.py checks the mark is the decorator's."""
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _kernel_imports(op: str) -> bool:
    """Whether the Triton kernel of `op` imports (importing it). torch.compile runs this for real
    while it traces a caller and takes the answer as a constant: importlib cannot be traced, and
    the graph break it would leave in every Mamba layer's training forward splits the graph."""
    return _import_kernel(op)[0] is not None


def kernel(op: str, device: torch.device) -> Callable | None:
    """The Triton kernel that runs `op` for tensors on `device` now, or None: the reference.
    (Runs for every op of every layer of every eager decode step: no more than a few lookups.)"""
    backend = settings().backend
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return None
    if not _kernel_imports(op):
        if backend == "triton" and op in TRITON_KERNELS:
            raise CodePathError(f"the triton backend was asked for, but {_import_kernel(op)[1]} for {op}")
        return None
    module, name = TRITON_KERNELS[op]
    return getattr(sys.modules[module], name)  # imported by _kernel_imports; a lookup torch.compile traces


def check_device(device: torch.device) -> None:
    """Raise CodePathError where the backend in force cannot run on `device`: the triton backend
    off CUDA, outside Triton's interpreter (Triton itself would fail at the first launch, with
    "0 active drivers"). Commands call it once they know their device."""
    if settings().backend == "triton" and device.type != "cuda" and not settings().interpret:
        raise CodePathError(f"the triton backend runs on a CUDA GPU (or on the CPU under TRITON_INTERPRET=1, for "
                            f"tests), not on {device.type}: use --backend auto or reference there")


def _kernel_reason(op: str, device: torch.device) -> str:
    """Why `kernel(op, device)` chose what it did (for `explain`)."""
    backend = settings().backend
    if backend == "reference":
        return "backend reference"
    if backend == "auto" and device.type != "cuda":
        return f"backend auto on {device.type}"
    missing = _import_kernel(op)[1]
    return missing if missing is not None else f"backend {backend} on {device.type}"


# --- per model: the fused kernel path, the split verify layer, the one-launch kernels -------------

def _add_norm_max_dim() -> int:
    from .step_update.triton import ADD_RMS_NORM_MAX_DIM

    return ADD_RMS_NORM_MAX_DIM


def fused_layers(d_model: int, device: torch.device) -> bool:
    """Whether a model of width d_model runs its step and verify on the kernel path (residual adds
    inside the next norm's launch, norms folded into projections): where the fused add + norm
    kernel runs and takes rows this wide. Callers also need autograd off (inference only)."""
    return kernel("add_rms_norm", device) is not None and d_model <= _add_norm_max_dim()


SPLIT_IN_PROJ_MIN_ROWS = 33
"""Rows (batch x tree nodes) from which the verify layer splits in_proj (ops/overlap.py). At
mamba2-2.7b on the H100 the 64-node iteration is faster split, the 16-node one slower: there the
conv and scan are short and the second GEMM launch costs more than the overlap gives
(docs/BENCHMARKS.md)."""


def leaves_an_sm(programs: int, device: torch.device) -> bool:
    """Whether a launch of `programs` programs leaves at least one of `device`'s SMs free of them
    even if each program takes a whole SM."""
    if device.type != "cuda":
        return True  # the CPU interpreter runs launches one after another
    return programs < torch.cuda.get_device_properties(device).multi_processor_count


def splits_in_proj(rows: int, batch: int, d_inner: int, rest: int, k: int, element_size: int, heads: int,
                   head_dim: int, device: torch.device) -> bool:
    """Whether a verify layer of `rows` rows runs z's GEMM (the first d_inner of in_proj's
    d_inner + rest outputs, K inputs) beside its conv and scan (ops/overlap.py). Not when the
    kernels are not in use, for too few rows, for a half that the skinny GEMM does not take, when
    z's tiles are not whole heads, or when the scan's programs could fill every SM while they wait."""
    return _split_reason(rows, batch, d_inner, rest, k, element_size, heads, head_dim, device) is None


def _split_reason(rows, batch, d_inner, rest, k, element_size, heads, head_dim, device) -> str | None:
    if rows < SPLIT_IN_PROJ_MIN_ROWS:
        return f"{rows} rows, fewer than {SPLIT_IN_PROJ_MIN_ROWS}"
    if kernel("tree_scan_gated", device) is None or kernel("norm_linear", device) is None:
        return "the Triton kernels are not in use"
    if device.type != "cuda" and not interpreting():
        return "needs CUDA"
    from .gemv import triton as gemv
    from .tree_scan import triton as scan

    if not (gemv.skinny_rows(rows, d_inner, k, element_size) and gemv.skinny_rows(rows, rest, k, element_size)):
        return "the skinny GEMM does not take both halves"
    width = gemv.skinny_tile_width(d_inner, k, rows)
    if not width or width % head_dim:
        return "z's GEMM tiles are not whole heads"
    if not leaves_an_sm(scan.gated_programs(batch, heads, head_dim), device):
        return "the scan's programs could fill every SM"
    return None


def _stream_modules():
    from . import stream_layers, stream_proj

    return stream_layers, stream_proj


def step_reason(model, batch: int, device: torch.device) -> str | None:
    """Why `model`'s decode step of `batch` rows cannot run in one launch here, or None."""
    if settings().stream_layers == "off":
        return f"{STREAM_LAYERS_ENV}=0"
    return _stream_modules()[0].unsupported_reason(model, batch, device)


def verify_reason(model, rows: int, device: torch.device) -> str | None:
    """Why a verify of `rows` rows of `model` cannot take its projections from the one-launch
    kernel here, or None."""
    if settings().stream_layers == "off":
        return f"{STREAM_LAYERS_ENV}=0"
    return _stream_modules()[1].unsupported_reason(model, rows, device)


def prebuild(models) -> list[str]:
    """Build both one-launch extensions for every model that can use them on this machine, in
    parallel (nvcc runs one process per build): one wait of about a minute instead of one per
    shape at first use. Returns why each model that cannot was skipped."""
    import concurrent.futures

    from .stream_layers import cuda as stream_layers
    from .stream_proj import cuda as stream_proj

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    jobs, skipped = {}, []
    for model in models:
        m = model.mamba_mixers()[0]
        shape = (tuple(m.in_proj.weight.shape), tuple(m.out_proj.weight.shape), m.cfg.n_heads, m.cfg.conv_kernel,
                 m.dt_bias.dtype)
        for name, op, reason in (("stream_layers", stream_layers, step_reason(model, 1, device)),
                                 ("stream_proj", stream_proj, verify_reason(model, stream_proj.MAX_NODES, device))):
            if reason is None:
                jobs.setdefault((name, shape), (op, model))  # one build per shape
            else:
                skipped.append(f"{name}: {reason}")
    with concurrent.futures.ThreadPoolExecutor(max(1, len(jobs))) as pool:
        list(pool.map(lambda job: job[0].build(job[1]), jobs.values()))
    return skipped


class OneLaunchRunners:
    """A model's one-launch CUDA kernels (ops/stream_layers for the batch-1 step, ops/stream_proj
    for verifies of up to 16 rows), decided once per model, device and row count: built on first
    use, or None where they cannot run (the model keeps the Triton kernels). Decided before a CUDA
    graph captures the call (StepGraph and GreedyTreeGraph run it eagerly first): never built
    during a capture. The build-failure policy: the default mode warns once and falls back,
    SSMSPEC_STREAM_LAYERS=1 raises; only =1 warns (once per kernel) where they cannot run.
    """

    def __init__(self):
        self._runners: dict = {}
        self._reasons: dict = {}
        self._warned: set[str] = set()

    def step(self, model, batch: int, device: torch.device):
        """The decode step's runner (`runner(h, cache)`, ops/stream_layers) or None."""
        if batch != 1 or settings().stream_layers == "off":
            return None
        stream_layers = _stream_modules()[0]
        return self._runner("step", device, lambda: step_reason(model, batch, device),
                            lambda: stream_layers.StreamLayers(model, device), "the one-launch layer stack",
                            "the decode step keeps the Triton kernels")

    def verify(self, model, rows: int, device: torch.device):
        """The verify's projection runner (ops/stream_proj) for `rows` rows, or None."""
        if settings().stream_layers == "off":
            return None
        stream_proj = _stream_modules()[1]
        if (rows, device) not in self._reasons:
            self._reasons[rows, device] = verify_reason(model, rows, device)
        why = self._reasons[rows, device]
        if why is not None:
            if rows <= stream_proj.MAX_NODES:  # larger trees never take it: nothing to say
                self._say("verify", why, "the verify's weight-stream projections",
                          "the tree verify keeps the Triton kernels")
            return None
        return self._runner("verify", device, lambda: None, lambda: stream_proj.StreamProj(model, device),
                            "the verify's weight-stream projections", "the tree verify keeps the Triton kernels")

    def kept(self, which: str, device: torch.device):
        """The runner built for `which` ("step" or "verify") on `device`, or None."""
        return self._runners.get((which, device))

    def _say(self, which: str, why: str, what: str, fallback: str) -> None:
        if settings().stream_layers == "on" and which not in self._warned:
            self._warned.add(which)
            warnings.warn(f"{STREAM_LAYERS_ENV}=1, but {what} cannot run: {why}; {fallback}", stacklevel=5)

    def _runner(self, which: str, device: torch.device, reason, build, what: str, fallback: str):
        key = (which, device)
        if key in self._runners:
            return self._runners[key]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return None
        runner = None
        why = reason()
        if why is not None:
            self._say(which, why, what, fallback)
        else:
            try:
                runner = build()
            except Exception as e:  # a compiler or toolkit that fails to build it
                if settings().stream_layers == "on":
                    raise CodePathError(f"{STREAM_LAYERS_ENV}=1, but {what} failed to build: {e}") from e
                warnings.warn(f"{what} failed to build ({type(e).__name__}: {e}); {fallback} "
                              f"({STREAM_LAYERS_ENV}=0 skips the build)", stacklevel=5)
        self._runners[key] = runner
        return runner


# --- explain ---------------------------------------------------------------------------------------

def explain(model=None, device: torch.device | None = None, tree_nodes: int = 16) -> list[str]:
    """Which code runs, and why, one line per op, then (given a model) per model path: the fused
    kernel path, the one-launch decode step and verify (trees of `tree_nodes` nodes at batch 1)
    and the split verify layer. Builds nothing. device: the model's, else CUDA when there is one."""
    if device is None:
        device = model.device if model is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = settings()
    lines = [f"settings: backend {s.backend}, one-launch kernels {s.stream_layers}, "
             f"Triton interpreter {'on' if s.interpret else 'off'}; device {device}"]
    for op in ("chunk_scan", *TRITON_KERNELS):
        try:
            impl = kernel(op, device)
        except CodePathError as e:
            lines.append(f"{op}: unavailable ({e})")
            continue
        lines.append(f"{op}: {'triton' if impl is not None else 'reference'} ({_kernel_reason(op, device)})")
    if model is None:
        return lines
    d_model = model.config.d_model
    try:
        fused = fused_layers(d_model, device)
    except CodePathError:
        fused = False
    if not fused:
        why = _fused_reason(d_model, device)
        lines.append(f"model layers: plain per-op path ({why})")
        lines.append(f"decode step (batch 1), verify: the plain per-op path ({why})")
    else:
        lines.append("model layers: fused kernel path (residual adds inside the norms, norms folded into projections)")
        why = step_reason(model, 1, device)
        lines.append("decode step (batch 1): " + ("cuda-one-launch (ops/stream_layers)" if why is None
                                                  else f"triton ({why})"))
        why = verify_reason(model, tree_nodes, device)
        lines.append(f"verify ({tree_nodes} nodes): " + ("cuda-one-launch projections (ops/stream_proj)"
                                                        if why is None else f"triton ({why})"))
        mixers = model.mamba_mixers()
        if mixers:
            m = mixers[0]
            c, w = m.cfg, m.in_proj.weight
            for nodes in sorted({tree_nodes, 64}):
                why = _split_reason(nodes, 1, c.d_inner, c.conv_dim + c.n_heads, w.shape[1], w.element_size(),
                                    c.n_heads, c.head_dim, device)
                lines.append(f"verify ({nodes} nodes), in_proj: " + ("split, z's GEMM beside the conv and scan"
                                                                     if why is None else f"one GEMM ({why})"))
    return lines


def _fused_reason(d_model: int, device: torch.device) -> str:
    try:
        if kernel("add_rms_norm", device) is None:
            return _kernel_reason("add_rms_norm", device)
    except CodePathError as e:
        return str(e)
    return f"d_model {d_model} wider than the fused add + norm kernel's {_add_norm_max_dim()}"
