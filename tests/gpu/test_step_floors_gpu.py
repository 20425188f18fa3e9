"""Batch-1 decode steps against their floors on a GPU (opt in: --run-gpu; issue 23: small models are
latency bound, so the step of every preset width and of the drafter is held close to its floor).

The floor of a target's step is its bf16 weights read once: parameter bytes over the device-to-device
copy bandwidth measured in this process, as bench/bench_decode.py computes it. The step is the
product's own: a CUDA-graphed `StepGraph` in the default mode (norm weights folded, the one-launch
layer stack where it runs), random weights, after a few seconds of replays so the clocks are up.

The bounds are today's H100 figures (2026-11-28, bench_decode.py, docs/BENCHMARKS.md) with about 15%
of headroom for drift between machines: mamba2-130m 0.300 ms = 3.50x its 0.086 ms floor, mamba2-780m
0.828 ms = 1.60x, mamba2-1.3b 1.198 ms = 1.34x. The small widths sit further from the weight-read
floor because their step is a few microseconds of work per layer behind fixed launch and
synchronisation costs. drafter-2l is timed at the trained pair's 8,192-token vocabulary: it reads
about 7 MB (a floor of ~2 us), so its bound is absolute; its step inside the fused draft measured
0.032 ms a level (tune-tree's profile of that pair, same day).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.requires_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bench_decode import copy_bandwidth, median_ms, param_bytes, prefilled_cache  # noqa: E402

TARGET_BOUNDS = {"mamba2-130m": 4.0, "mamba2-780m": 1.85, "mamba2-1.3b": 1.55}
"""preset -> the most the default mode's AR step may cost, in weight-read floors."""
DRAFTER_STEP_MS = 0.06


def _step_ms(preset: str, vocab_size: int | None = None) -> tuple[float, float]:
    """(the default mode's AR step in ms, the weight-read floor in ms) for a random bf16 preset."""
    from ssmspec.decoding.graphs import StepGraph
    from ssmspec.models.presets import build_model

    torch.manual_seed(0)
    bandwidth = copy_bandwidth()
    model = build_model(preset, vocab_size=vocab_size, dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
    floor_ms = param_bytes(model) / bandwidth * 1000
    vocab = model.config.vocab_size
    cache = prefilled_cache(model, torch.randint(0, vocab, (1, 32), device="cuda"), 256)
    snapshot = cache.clone()
    graph = StepGraph(model, cache)
    ids = torch.randint(0, vocab, (1, 1), device="cuda")
    started = time.time()
    while time.time() - started < 2.0:  # clocks up from idle; the cache restored before it fills
        for _ in range(50):
            graph(ids)
        cache.copy_(snapshot)
    torch.cuda.synchronize()
    ms = median_ms(lambda: graph(ids), iters=100)
    print(f"{preset}: AR step {ms:.3f} ms, floor {floor_ms:.3f} ms, {ms / floor_ms:.2f}x")
    return ms, floor_ms


@pytest.mark.parametrize("preset", list(TARGET_BOUNDS))
def test_target_step_is_close_to_its_weight_read_floor(preset):
    ms, floor_ms = _step_ms(preset)
    assert ms / floor_ms <= TARGET_BOUNDS[preset], (
        f"{preset}: the AR step takes {ms:.3f} ms, {ms / floor_ms:.2f}x its {floor_ms:.3f} ms weight-read floor "
        f"(bound {TARGET_BOUNDS[preset]}x)")


def test_drafter_step_is_latency_bound_and_short():
    ms, floor_ms = _step_ms("drafter-2l", vocab_size=8192)
    assert ms <= DRAFTER_STEP_MS, f"drafter-2l: the step takes {ms:.3f} ms (bound {DRAFTER_STEP_MS} ms)"
