"""How one micro-batch's forward, loss and backward execute: eagerly, compiled, or replayed from a CUDA graph.

A Mamba-2 layer trained in plain torch is a few dozen small launches, and mamba_ssm's fused SSD
spends about 1.4 ms of host time per layer forward and 3.5 ms per backward launching its Triton
kernels (H100, mamba2-130m, 16 x 512 tokens: GPU busy 101 ms of a 206 ms step). Two remedies:

- torch.compile of the student's forward (Inductor fuses each layer's elementwise work; the scan
  stays one opaque node, see training/scan.py): GPU time per step 101 -> 45 ms at that shape.
- A CUDA graph per micro-batch shape: the whole forward, loss and backward captured once, after
  WARMUP_RUNS ordinary runs of that shape (autotuning, lazy initialisation, compiles), then
  replayed with the next batch copied into its input buffers. The host launches one graph.

With one micro-batch an optimizer step, the captured backward writes the gradients: the .grad
tensors are its own outputs, put back on the parameters at every replay, and the optimizer sets
them to None between steps (no zero fill, no add into zeros; H200, mamba2-130m 16 x 512: +0.8 to
+3.6% tokens/s over four same-machine pairs, peak memory 6.45 GB vs 6.82).
With several, the graph accumulates into the parameters' existing .grad tensors, so the optimizer
must zero them in place (`keeps_grads`), never set them to None. `plan_step` is the one place
that decides whether to compile and capture.
"""
from __future__ import annotations

import contextlib
import gc
import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch

from ssmspec.errors import InputError

log = logging.getLogger(__name__)

WARMUP_RUNS = 2
CAPTURE_ATTEMPTS = 2
"""An automatic capture that fails is tried once more at the next micro-batch before graphs are dropped:
one `sft` run of eleven on an H200 (11-28, the host's other GPU training) gave its capture up and trained
at 1.45x plain torch instead of 6.6x, and the ten others captured; a failure that repeats costs one more
attempt."""


@dataclass(frozen=True)
class StepPlan:
    """What the run's micro-steps use, and why (reported in the run log). An asked-for choice that
    fails raises; an automatic one is dropped (`MicroStep`)."""

    compile: bool
    cuda_graphs: bool
    reason: str
    compile_asked: bool = False
    graphs_asked: bool = False

    @property
    def name(self) -> str:
        parts = [p for p, on in (("torch.compile", self.compile), ("CUDA graph", self.cuda_graphs)) if on]
        return " + ".join(parts) or "eager"


def plan_step(compile: bool | None, cuda_graphs: bool | None, device: torch.device, processes: int,
              target_cache: bool) -> StepPlan:
    """compile / cuda_graphs: True or False as asked, None for automatic (on wherever they apply).

    CUDA graphs need one CUDA process (a multi-GPU run's gradient all-reduce is not captured) and
    no top-K cache of target logits (which decides on the host, per batch, what the target runs on).
    """
    on_cuda = torch.device(device).type == "cuda"
    why_no_graphs = ("the device is not CUDA" if not on_cuda else
                     f"{processes} processes (the gradient all-reduce is not captured)" if processes > 1 else
                     "--cache-target-logits chooses per batch on the host" if target_cache else None)
    if cuda_graphs and why_no_graphs:
        raise InputError(f"--cuda-graphs asked for, but {why_no_graphs}; leave it out or use --no-cuda-graphs")
    use_compile = on_cuda if compile is None else compile
    use_graphs = why_no_graphs is None if cuda_graphs is None else cuda_graphs
    reasons = []
    if compile is None:
        reasons.append("torch.compile on a CUDA device" if use_compile else "no torch.compile off CUDA")
    if cuda_graphs is None:
        reasons.append("CUDA graphs" if use_graphs else f"no CUDA graphs: {why_no_graphs}")
    return StepPlan(use_compile, use_graphs, "; ".join(reasons) or "asked for", compile_asked=compile is True,
                    graphs_asked=cuda_graphs is True)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    mask: torch.Tensor
    loss: torch.Tensor
    parts: dict
    grads: list | None = None  # (parameter, the gradient the replay writes) when the graph owns them


class MicroStep:
    """`step(ids, mask) -> (loss, detached parts)`: forward, loss and backward (of loss / divisor) of one micro-batch.

    loss_fn(forward, ids, mask, rows) computes (loss, parts) with forward as the student; backward(loss)
    runs autograd (accelerate's, for its gradient handling). Both run inside `autocast()`.
    Automatic choices that fail (a compile error on first use; a capture error, CAPTURE_ATTEMPTS times)
    are reported through `on_message` and dropped for the rest of the run; asked-for ones raise.
    """

    def __init__(self, plan: StepPlan, model: torch.nn.Module, loss_fn: Callable, backward: Callable, divisor: int,
                 autocast: Callable[[], contextlib.AbstractContextManager], on_message: Callable[[str], None] = lambda m: None):
        self.plan, self.model, self.loss_fn, self.backward, self.divisor = plan, model, loss_fn, backward, divisor
        self.autocast, self.on_message = autocast, on_message
        self.forward = torch.compile(model, dynamic=False) if plan.compile else model
        self._runs: dict[tuple, int] = {}
        self._graphs: dict[tuple, _Captured] = {}
        self._failed_captures = 0

    @property
    def captured(self) -> int:
        """How many micro-batch shapes run from a captured CUDA graph."""
        return len(self._graphs)

    @property
    def owns_grads(self) -> bool:
        """One micro-batch an optimizer step: a captured graph writes the gradients, never adds."""
        return self.divisor == 1

    @property
    def keeps_grads(self) -> bool:
        """True once a graph that adds into the .grad tensors it saw is captured: they must stay."""
        return bool(self._graphs) and not self.owns_grads

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor, rows=None):
        """rows: the batch's block indices for a top-K target cache (`plan_step` leaves graphs out then), or None."""
        key = (tuple(ids.shape), tuple(mask.shape))
        captured = self._graphs.get(key)
        if captured is None:
            runs = self._runs[key] = self._runs.get(key, 0) + 1
            if runs <= WARMUP_RUNS:
                return self._first_runs(ids, mask, rows)
            if not self.plan.cuda_graphs:
                return self._run(ids, mask, rows)
            captured = self._capture(ids, mask)  # records only: the replay below runs this micro-batch
            if captured is None:
                return self._run(ids, mask, rows)
            self._graphs[key] = captured
        captured.ids.copy_(ids, non_blocking=True)
        captured.mask.copy_(mask, non_blocking=True)
        captured.graph.replay()
        for p, grad in captured.grads or ():
            p.grad = grad
        return captured.loss, captured.parts

    def _run(self, ids, mask, rows=None):
        with self.autocast():
            loss, parts = self.loss_fn(self.forward, ids, mask, rows)
        self.backward(loss / self.divisor)  # the mean over the optimizer step's micro-batches
        # Detached: a caller holding the loss would keep this run's autograd graph, and with it the
        # parameters' AccumulateGrad nodes, alive into the next call; a capture there accumulates
        # through those default-stream nodes and fails (cudaErrorStreamCaptureInvalidated).
        return loss.detach(), parts

    def _first_runs(self, ids, mask, rows):
        """The first runs of a shape, where an automatic compile may fail (before any gradient is written)."""
        try:
            return self._run(ids, mask, rows)
        except Exception as error:  # Inductor and Dynamo raise many types
            if not self.plan.compile or self.plan.compile_asked or not _is_compile_error(error):
                raise
            why = _first_line(error)
        self.on_message(f"torch.compile failed ({why}); this run goes on without it (--no-compile skips the attempt)")
        self.plan = replace(self.plan, compile=False, reason=self.plan.reason + "; torch.compile failed")
        self.forward = self.model
        return self._run(ids, mask, rows)

    def _capture(self, ids, mask) -> _Captured | None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        accumulated = any(p.grad is not None for p in params)  # earlier micro-batches of this optimizer step
        for p in params:
            if self.owns_grads:
                p.grad = None  # the recorded backward allocates each gradient in the graph's pool
            elif p.grad is None:  # the graph adds into these; a missing one would be allocated inside the graph
                p.grad = torch.zeros_like(p)
        grads = None if self.owns_grads else [p.grad.data_ptr() for p in params]  # the ones the graph must add into
        static_ids, static_mask = ids.clone(), mask.clone()
        # An earlier run's autograd graph that only a reference cycle holds lives until the collector
        # next runs, and with it the parameters' AccumulateGrad nodes of the default stream: the
        # capture fails on them (torch warns of their stream first). H200, 2026-11-28: the three sft
        # runs after a machine's first (Inductor's caches warm, far fewer allocations to trigger the
        # collector) gave their captures up with that warning (57-58k against 249k tokens/s); with
        # this collection the two warm runs since captured (250k).
        gc.collect()
        torch.cuda.synchronize(ids.device)
        torch.cuda.empty_cache()  # the warm-up runs' blocks, for the graph's own pool
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                loss, parts = self._run(static_ids, static_mask)
            if grads is not None and [p.grad.data_ptr() if p.grad is not None else 0 for p in params] != grads:
                raise RuntimeError("the captured backward replaced .grad tensors instead of adding into them")
        except Exception as error:
            # A capture runs nothing, so the gradients hold what they held, unless the recorded
            # backward put graph-pool tensors in their place (then they are lost); a graph that owns
            # them started from None, so whatever any holds now is the pool's
            replaced = params if grads is None else \
                [p for p, ptr in zip(params, grads) if p.grad is None or p.grad.data_ptr() != ptr]
            if self.plan.graphs_asked:
                raise
            if replaced and accumulated:
                raise RuntimeError("a CUDA graph capture failed after replacing gradients of earlier micro-batches; "
                                   "run again with --no-cuda-graphs") from error
            self._failed_captures += 1
            if self._failed_captures < CAPTURE_ATTEMPTS:
                self.on_message(f"CUDA graph capture failed ({_first_line(error)}); trying again at the next micro-batch")
            else:
                self.on_message(f"CUDA graph capture failed ({_first_line(error)}); "
                                "this run goes on without graphs (--no-cuda-graphs skips the attempt)")
                self.plan = replace(self.plan, cuda_graphs=False, reason=self.plan.reason + "; CUDA graph capture failed")
            for p in replaced:
                p.grad = None  # it held zeros before the capture: the next backward starts a fresh one
            return None
        log.info("captured a CUDA graph of the micro-step for batch %s", tuple(ids.shape))
        owned = [(p, p.grad) for p in params if p.grad is not None] if self.owns_grads else None
        return _Captured(graph, static_ids, static_mask, loss, parts, owned)


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def _is_compile_error(error: Exception) -> bool:
    module = type(error).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor")) or "BackendCompilerFailed" in type(error).__name__
