"""The timing harness of `ssmspec profile`, importable by benchmarks: `time_call` and its `Timing`.

A benchmark times a repeatable call with
``time_call(fn, warmup=3, repeats=20, device="cuda", cuda_graph=True, setup=restore).median``
(milliseconds; ``setup`` runs before each call, outside the timed window). On the CPU, wrap the
measurement in ``cpu_threads(default_cpu_threads())``; ``samples_disagree`` says when repeated
timings of one call are too far apart to trust.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ..errors import InputError
from ..ops import graph_tables


DISAGREE_MAX_OVER_MIN = 2.0
"""Repeated timings of one call disagree when the slowest is more than this times the fastest..."""
DISAGREE_IQR_OVER_MEDIAN = 0.5
"""...or their interquartile range is more than this fraction of their median."""


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

    @property
    def disagrees(self) -> bool:
        """Whether the samples are too far apart to trust (see `samples_disagree`)."""
        return samples_disagree(self.samples)

    def to_dict(self) -> dict:
        return {
            "mode": self.mode, "note": self.note, "median": self.median, "min": self.min, "max": self.max,
            "q1": self.q1, "q3": self.q3, "iqr": self.iqr, "samples": list(self.samples),
        }


def samples_disagree(samples: Sequence[float]) -> bool:
    """Whether repeated timings of one call disagree: max/min > 2 or IQR/median > 0.5.

    Either means the call did not cost the same each time (a busy machine, threads waiting for
    a core, frequency changes), so its median is not a cost the fits can use.
    """
    lo, hi = min(samples), max(samples)
    if hi > DISAGREE_MAX_OVER_MIN * lo:
        return True
    median = statistics.median(samples)
    iqr = float(np.percentile(samples, 75) - np.percentile(samples, 25))
    return median > 0 and iqr > DISAGREE_IQR_OVER_MEDIAN * median


def default_cpu_threads() -> int:
    """Threads for timing small calls on the CPU: OMP_NUM_THREADS when the user set it, else 1.

    On calls of a few milliseconds, torch's default of one thread per core spends much of its
    time handing work between threads, and on a machine shared with other work a thread that
    waits for a busy core turns a 5 ms call into a 500 ms one; one thread gives stable timings.
    """
    from ..ops.settings import environment

    return environment().omp_threads or 1


@contextmanager
def cpu_threads(n: int | None) -> Iterator[None]:
    """torch's CPU thread count set to n inside the block and restored after it (None: left as it is)."""
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _capture(fn: Callable[[], object], device: torch.device, setup: Callable[[], object]):
    """A CUDA graph of fn, or (None, reason) when fn cannot be captured (e.g. it syncs with the host).

    A failed capture leaves torch on the capture stream; the caller's stream is restored here.
    """
    graph = torch.cuda.CUDAGraph()
    caller = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(caller)
    try:
        with torch.cuda.stream(side):
            setup()
            fn()  # allocations on the capture stream before capture, as torch recommends
        caller.wait_stream(side)
        with graph_tables.capture(graph):
            fn()
        setup()
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
    setup: Callable[[], object] | None = None,
) -> Timing:
    """Time fn() `repeats` times after `warmup` untimed calls.

    On CUDA each call is bracketed by CUDA events (no host sync between calls, one
    `torch.cuda.synchronize` at the end), and with `cuda_graph` the call is captured into a CUDA
    graph and replayed, falling back to eager (with `Timing.note` saying why) when capture is
    impossible. On the CPU each call is timed with `time.perf_counter`.

    fn must be repeatable: each call must do the same work (reset what it advances), or `setup`
    must make it so: setup() runs before every call of fn, outside the timed window (on CUDA its
    work is enqueued before the start event, and stays out of the captured graph).
    """
    if repeats < 1:
        raise InputError(f"repeats must be >= 1, got {repeats}")
    setup = setup or _nothing
    device = torch.device(device)
    if device.type != "cuda":
        for _ in range(warmup):
            setup()
            fn()
        samples = []
        for _ in range(repeats):
            setup()
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return Timing(samples)

    for _ in range(warmup):
        setup()
        fn()
    torch.cuda.synchronize(device)
    run, mode, note, graph = fn, "eager", None, None
    if cuda_graph:
        graph, note = _capture(fn, device, setup)
        if graph is not None:
            run, mode = graph.replay, "cuda_graph"
            for _ in range(warmup):
                setup()
                run()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for s, e in zip(starts, ends):
        setup()
        s.record()
        run()
        e.record()
    torch.cuda.synchronize(device)
    samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    del graph  # frees the graph's private memory pool
    return Timing(samples, mode, note)


def _nothing() -> None:
    return None
