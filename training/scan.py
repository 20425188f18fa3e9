"""Which chunked SSD scan Mamba-2 layers train through: chosen once per run, reported in the run log."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from typing import Callable

import torch

from ssmspec.errors import InputError

from .scan_op import scan_ops


@dataclass
class TrainingScan:
    """The scan a run uses: its name (for log.jsonl), why it was chosen, and the function itself.

    fn has `naive_chunk_scan`'s contract: (x, dt, A, B, C, D, chunk_size, initial_state) -> (y, final fp32),
    y in fp32 or in x's dtype (the mixer rounds it to the layer's dtype next either way).
    """

    name: str
    reason: str
    fn: Callable
    traceable: bool = False  # torch.compile can trace fn (custom ops inside); else it runs as one disabled call
    packed: Callable | None = None
    """The same scan on the conv's output [x | B | C] whole: (xBC, dt, A, D, chunk_size, head_dim, groups) ->
    (y, final), from zero state with D, its gradient of xBC whole (no copy assembling it from three); or None."""


def _import_mamba_ssd() -> Callable | None:
    """mamba_ssm's fused Triton SSD (`mamba_chunk_scan_combined`), or None where its sources are absent.

    mamba_ssm's package `__init__` imports its compiled selective-scan extension, which an install
    without a CUDA build lacks (or sources on PYTHONPATH); the Triton SSD needs none of it. Where
    the plain import fails, the SSD's modules are imported under a stand-in package that skips
    that `__init__`, and every module this added is taken out of sys.modules again (the function
    keeps what it needs), so the process looks as if mamba_ssm never imported.
    """
    before = set(sys.modules)

    def forget_what_this_added():
        for name in set(sys.modules) - before:
            if name == "mamba_ssm" or name.startswith("mamba_ssm."):
                del sys.modules[name]

    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
        return mamba_chunk_scan_combined
    except Exception:
        forget_what_this_added()  # the modules of the failed `__init__`
    try:
        spec = importlib.util.find_spec("mamba_ssm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    package = types.ModuleType("mamba_ssm")
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["mamba_ssm"] = package
    try:
        return importlib.import_module("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
    except Exception:
        return None
    finally:
        forget_what_this_added()


def _keep_autotuning_on_disk(entry: Callable) -> None:
    """Have Triton keep the autotuning winners of the kernels behind `entry` (two module levels down) on disk.

    mamba_ssm's SSD kernels benchmark every config on their first call per shape, again in every
    new process unless kept (with Inductor's compiles, a mamba2-130m-shape run's first three steps
    took 92-126 s on an H100).
    """
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        return
    namespaces, seen = [entry.__globals__], set()
    for _ in range(2):
        found = []
        for namespace in namespaces:
            for value in namespace.values():
                if isinstance(value, Autotuner) and hasattr(value, "cache_results"):
                    value.cache_results = True
                elif callable(value) and getattr(value, "__module__", "").startswith("mamba_ssm") \
                        and hasattr(value, "__globals__") and id(value.__globals__) not in seen:
                    seen.add(id(value.__globals__))
                    found.append(value.__globals__)
        namespaces = found


def _widen_dx_autotuning(namespace: dict) -> None:
    """Add two- and fewer-stage variants of the small tiles to the configs mamba_ssm's dx kernel autotunes over.

    Its list has four warps and four or five stages for every tile; at the mamba2-130m layer (16 x 512,
    24 heads of 64, d_state 128, chunks of 128, bf16) on an H200 (2026-11-28, each config alone,
    CUDA-graph replays) its pick took 0.0956 ms, the same 32 x 64 tile at two warps and three stages
    0.0810 (four warps, two stages 0.0848; 64 x 64 at two warps, three stages 0.0883). The autotuner
    still chooses by its own timings, once per shape (kept on disk). Not in mamba_ssm's deterministic
    mode, or where it pinned one config: a choice by timings could differ from run to run.
    """
    tuner = namespace.get("_chunk_scan_chunk_state_bwd_dx_kernel")
    if tuner is None or not hasattr(tuner, "configs") or getattr(tuner, "_ssmspec_widened", False):
        return
    deterministic = namespace.get("use_deterministic_mode")
    if len(tuner.configs) < 2 or deterministic is None or deterministic():
        return
    import copy

    added = []
    for config in tuner.configs:
        if config.kwargs.get("BLOCK_SIZE_M", 0) * config.kwargs.get("BLOCK_SIZE_N", 0) <= 64 * 64:
            for warps, stages in ((2, 3), (4, 2)):
                variant = copy.copy(config)  # keeps its pre_hook (zeroing the atomically summed ddt, dD)
                variant.num_warps, variant.num_stages = warps, stages
                added.append(variant)
    tuner.configs = list(tuner.configs) + added
    tuner._ssmspec_widened = True


MAMBA_SSM_CHUNK = 128
"""The largest chunk mamba_ssm's SSD trains with (the result does not depend on it, only rounding does).
sft at the mamba2-130m shape (chunk 256 in its config), 16 x 512, H200, 2026-11-28, 40-step runs beside
other jobs on the host's other GPUs: chunks of 128 beat 256 in all four pairs (by 6-40%: noisy runs) and
64 in both pairs (by 5-9%); at the 1.3b shape 128 gave 32.5% MFU, 256 32.9% (separate runs)."""


_SIDE_STREAMS: dict = {}


@contextlib.contextmanager
def _beside(like: torch.Tensor):
    """Run the block's launches on a second stream of like's device, beside what follows; yields
    `join(*tensors)`, which makes the current stream wait for them (and marks the tensors as used
    there, so their memory is not handed out again while it reads them). Off CUDA: in line."""
    if not like.is_cuda:
        yield lambda *tensors: None
        return
    main = torch.cuda.current_stream(like.device)
    if like.device not in _SIDE_STREAMS:
        _SIDE_STREAMS[like.device] = torch.cuda.Stream(like.device)
    side = _SIDE_STREAMS[like.device]
    side.wait_stream(main)

    def join(*tensors):
        main.wait_stream(side)
        for t in tensors:
            t.record_stream(main)

    with torch.cuda.stream(side):
        yield join


def _mamba_ssm_scan() -> Callable | None:
    mamba_chunk_scan_combined = _import_mamba_ssd()
    if mamba_chunk_scan_combined is None:
        return None
    from ssmspec.ops.chunk_scan.decay_grad import decay_grad  # Triton: imported where mamba_ssm's kernels are
    from ssmspec.ops.chunk_scan.triton import chunk_scan_forward_keeping, keeping_chunk

    _keep_autotuning_on_disk(mamba_chunk_scan_combined)
    k = mamba_chunk_scan_combined.__globals__  # ssd_combined's namespace (out of sys.modules again): its kernels
    _widen_dx_autotuning(k)

    # mamba_ssm's own backward (`_mamba_chunk_scan_combined_bwd`) first computes the chunk cumsums,
    # the chunk states, their passing and C B^T again from the inputs; here the forward keeps them
    # (states in fp32, as that backward computes them; mamba_ssm's five launches below give its
    # gradients bit for bit, our one-launch forward within the GPU tests' tolerances). sft at the
    # mamba2-130m shape, 16 x 512, H200, 2026-11-28: 249,206 against 239,043 tokens/s, peak memory
    # 7.70 against 6.45 GB (the states: batch x chunks x heads x head_dim x d_state fp32 a layer;
    # --recompute drops them with the layer's other activations).
    def forward(x, dt, A, B, C, D, chunk_size):
        if keeping_chunk(chunk_size, x.dtype):  # one launch of ours for mamba_ssm's five below
            return chunk_scan_forward_keeping(x, dt, A, B, C, D, chunk_size)
        dA_cumsum, dt_chunks = k["_chunk_cumsum_fwd"](dt, A, chunk_size)
        states = k["_chunk_state_fwd"](B, x, dt_chunks, dA_cumsum, states_in_fp32=True)
        states, final = k["_state_passing_fwd"](states.flatten(-2), dA_cumsum[:, :, :, -1])
        states = states.unflatten(-1, (x.shape[-1], B.shape[-1]))
        CB = k["_bmm_chunk_fwd"](C, B, chunk_size, output_dtype=torch.float32)
        y, _ = k["_chunk_scan_fwd"](CB, x, dt_chunks, dA_cumsum, C, states, D=D)
        return y, final.unflatten(-1, states.shape[-2:]), dA_cumsum, dt_chunks, states, CB

    def kept_shapes(x, dt, A, B, C, D, chunk_size):
        (batch, length, heads, head_dim), (groups, d_state) = x.shape, B.shape[-2:]
        chunks = -(-length // chunk_size)
        per_chunk = ((batch, heads, chunks, chunk_size), torch.float32)
        return [per_chunk, per_chunk, ((batch, chunks, heads, head_dim, d_state), torch.float32),
                ((batch, chunks, groups, chunk_size, chunk_size), torch.float32)]

    def backward(dy, dfinal, x, dt, A, B, C, D, kept, chunk_size, out):
        dA_cumsum, dt_chunks, states, CB = kept
        dx_out, dB_out, dC_out = out  # views of one [dx | dB | dC] tensor
        dy = dy.contiguous()  # the kernels want unit stride along head_dim
        groups = B.shape[-2]
        # dCB and the within-chunk decay gradient need nothing of the states' chain below: they run
        # beside it on a second stream (joined before the products that read dCB)
        with _beside(dy) as join:
            dCB = k["_chunk_scan_bwd_dcb"](x, dt_chunks, dA_cumsum, dy, ngroups=groups).to(CB.dtype)
            ddA_within = k["_chunk_scan_bwd_ddAcs_stable"](x, dt_chunks, dA_cumsum, dy, CB)
        dstates = k["_chunk_scan_bwd_dstates"](C, dA_cumsum, dy, dtype=states.dtype)
        # in: the state entering each chunk, gradient of the state leaving it; out: the gradient of
        # the state entering each chunk, and the states rounded to x's dtype for the products below
        dstates, ddA_chunk_ends, _, states = k["_state_passing_bwd"](
            states.flatten(-2), dA_cumsum[:, :, :, -1], dstates.flatten(-2),
            dfinal_states=None if dfinal is None else dfinal.flatten(-2), has_initial_states=False,
            dstates_dtype=x.dtype, states_dtype=x.dtype)
        states, dstates = (t.unflatten(-1, (x.shape[-1], B.shape[-1])) for t in (states, dstates))
        _, ddt_chunks, dD = k["_chunk_scan_chunk_state_bwd_dx"](x, dt_chunks, dA_cumsum, B, CB, dy, dstates, D=D,
                                                                 dx=dx_out)
        dB, ddA_from_states = k["_chunk_state_bwd_db"](x, dt_chunks, dA_cumsum, dstates, B=B, ngroups=groups)
        dC, ddA_before = k["_chunk_scan_bwd_dC"](states, dA_cumsum, dy, C=C, ngroups=groups)
        join(dCB, ddA_within)
        k["_bmm_chunk_bwd"](C, dCB, residual=dB, out=dB_out)
        k["_bmm_chunk_bwd"](B, dCB.transpose(-1, -2), residual=dC, out=dC_out)
        # the decay gradients (the within-chunk products' in mamba_ssm's stable form, the chunk
        # states', the carried states' outputs', the state passing's) to dt's and A's in one launch
        # where mamba_ssm's own backward takes eight (ops/chunk_scan/decay_grad.py)
        ddt, dA = decay_grad(ddA_within, ddA_before, ddA_from_states, ddA_chunk_ends, ddt_chunks, dt, A)
        return ddt, dA, dD

    # The ops' names are in Inductor's on-disk cache keys, their signatures are not: a change of
    # either signature takes a new name, or a graph cached by an earlier version calls the old one.
    through_ops = scan_ops("ssmspec_mamba_ssd_packed", forward, backward, kept_shapes)
    continued = torch.compiler.disable(mamba_chunk_scan_combined)  # from a given state, or without D

    def scan(x, dt, A, B, C, D, chunk_size=64, initial_state=None):
        # dt is already softplus'd and clamped (no dt_bias, no softplus inside) and stays fp32: the
        # kernel takes it to fp32 before its cumsum anyway, and rounding it to bf16 first put bf16
        # error into every decay. y stays in x's dtype: a cast to fp32 here would be a copy each way
        # per layer that the mixer rounds back at once.
        chunk = min(chunk_size, MAMBA_SSM_CHUNK)
        if initial_state is None and D is not None:  # a Mamba-2 layer in training
            return through_ops(x, dt, A.float(), B, C, D, chunk)
        y, final = continued(x, dt, A.float(), B, C, chunk, D=D, initial_states=initial_state,
                             return_final_states=True)
        return y, final.float()

    def packed(xBC, dt, A, D, chunk_size, head_dim, groups):  # a Mamba-2 layer in training, its conv's output whole
        return through_ops.packed(xBC, dt, A.float(), D, min(chunk_size, MAMBA_SSM_CHUNK), head_dim, groups)

    scan.packed = packed
    return scan


def pick_training_scan(choice: str, device: torch.device) -> TrainingScan:
    """The one place that decides the training scan.

    auto: on a CUDA device fla (fla-core's chunked simple-GLA) when usable, else mamba_ssm's fused SSD
    when its sources import (`_import_mamba_ssd`: its compiled extension is not needed), else parallel; on the CPU ssmspec (the dispatcher's chunk_scan: the plain-torch
    `naive_chunk_scan`). parallel is `parallel_chunk_scan` (every chunk at once, plain torch, any
    device). fla and mamba_ssm asked for by name must be usable.
    """
    from ssmspec.ops import dispatch
    from ssmspec.ops.chunk_scan.fla import fla_available, fla_chunk_scan, fla_refusal

    on_cuda = torch.device(device).type == "cuda"
    if choice in ("auto", "fla"):
        version = fla_available() if on_cuda else None  # no import on the CPU: fla warns there, and takes seconds
        refused = fla_refusal(device) if version is not None else None
        if on_cuda and version is not None and refused is None:
            return TrainingScan(f"fla:chunk_simple_gla (fla-core {version})", "fla-core imports and the device is CUDA",
                                fla_chunk_scan)
        if choice == "fla":
            why = ("no CUDA device" if not on_cuda else refused or "fla-core is not importable (pip install fla-core einops)")
            raise InputError(f"--scan fla asked for, but {why}; use --scan auto, parallel or ssmspec")
    if choice in ("auto", "mamba_ssm"):
        scan = _mamba_ssm_scan() if on_cuda else None
        if scan is not None:
            return TrainingScan("mamba_ssm:mamba_chunk_scan_combined", "mamba_ssm imports and the device is CUDA", scan,
                                traceable=True, packed=scan.packed)
        if choice == "mamba_ssm":
            raise InputError("--scan mamba_ssm asked for, but mamba_ssm is not importable on a GPU here; use --scan parallel or ssmspec")
    if choice == "parallel" or (choice == "auto" and on_cuda):
        from ssmspec.ops.chunk_scan.parallel import parallel_chunk_scan

        reason = "asked for" if choice != "auto" else "neither fla-core nor mamba_ssm can train here"
        return TrainingScan("ssmspec:ssmspec.ops.chunk_scan.parallel.parallel_chunk_scan", reason, parallel_chunk_scan)
    impl = dispatch.resolve("chunk_scan", device)
    reason = "asked for" if choice == "ssmspec" else "no CUDA device"
    return TrainingScan(f"ssmspec:{impl.__module__}.{impl.__name__}", reason, impl)


@contextlib.contextmanager
def training_scan(choice: str, device: torch.device):
    """Route every Mamba-2 layer's `forward` through the picked scan while the block runs; yields it."""
    from ssmspec.ops import dispatch

    picked = pick_training_scan(choice, device)
    original = dispatch.chunk_scan, dispatch.packed_chunk_scan
    # Mamba2Mixer looks the function up on the module at call time. To torch.compile it is one
    # opaque node: mamba_ssm's kernels as custom ops (training/scan_op.py); fla's autograd Function
    # and the plain-torch scans (Inductor fails on their cumsums: SplitScan codegen, torch 2.11)
    # as a disabled call, a graph break in every layer.
    dispatch.chunk_scan = picked.fn if picked.traceable else torch.compiler.disable(picked.fn)
    dispatch.packed_chunk_scan = picked.packed
    try:
        yield picked
    finally:
        dispatch.chunk_scan, dispatch.packed_chunk_scan = original
