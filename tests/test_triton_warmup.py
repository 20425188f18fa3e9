"""ops/triton_warmup.py: Triton's once-per-process cache key computed on a side thread while a GPU model loads."""
from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import REPO

pytest.importorskip("triton")

# In a fresh interpreter (the key is kept per process, so this one may have it already): the warm-up
# thread computes Triton's key, after which the first kernel compile's call finds it cached.
_PROBE = r"""
import time
from ssmspec.ops import triton_warmup
key = triton_warmup._triton_key()
assert key is not None and key.cache_info().currsize == 0
thread = triton_warmup.start()
assert triton_warmup.start() is thread  # once per process
thread.join()
assert key.cache_info().currsize == 1
started = time.perf_counter()
key()
print(f"{time.perf_counter() - started:.6f}")
"""


def test_the_warm_up_thread_leaves_tritons_key_computed():
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert float(proc.stdout.split()[-1]) < 0.01  # a cached value, not 0.3 s of hashing


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_load_target_starts_the_warm_up_before_reading_weights_for_a_gpu_only(device, monkeypatch):
    import torch

    import ssmspec.api as api
    from ssmspec.ops import triton_warmup

    events = []
    monkeypatch.setattr(api, "resolve_device", lambda name: torch.device(device))
    monkeypatch.setattr(triton_warmup, "start", lambda: events.append("warm-up"))
    monkeypatch.setattr(api, "load_model", lambda path, dtype, device: events.append("load"))
    api.load_target("some/dir", device=device)
    assert events == (["warm-up", "load"] if device == "cuda" else ["load"])
