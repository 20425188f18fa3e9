"""Triton's once-per-process cost, paid on a side thread while the model loads.

Before its first kernel of a process, even one whose binary is already in the on-disk cache,
Triton computes the key that ties every cached kernel to the installed compiler: a SHA-256 of
its own Python sources and of its ~500 MB `libtriton.so` (`triton_key`, kept for the process).
That took 0.32 s of a first-kernel cache hit (0.34 s in all) on the 2-core CPU machine (Triton
3.9), against under 1 ms for each later one. A process that will decode on a GPU starts it here
while it reads the model's weights: hashlib releases the GIL while it hashes, so the two overlap,
and the first generation (`ssmspec generate` after `ssmspec prepare`) does not pay it.
"""
from __future__ import annotations

import threading
from typing import Callable

_thread: threading.Thread | None = None


def _triton_key() -> Callable[[], str] | None:
    """Triton's cached `triton_key`, wherever this Triton keeps it (None where it has none)."""
    try:
        from triton.runtime.cache import triton_key  # Triton >= 3.3
    except ImportError:
        try:
            from triton.compiler.compiler import triton_key
        except ImportError:
            return None
    # Only a function that keeps its result is worth computing ahead.
    return triton_key if hasattr(triton_key, "cache_info") else None


def start() -> threading.Thread | None:
    """Compute Triton's process-wide cache key on a daemon thread, once per process; returns the
    thread (the one already started, on later calls), or None where Triton has no such key."""
    global _thread
    if _thread is None:
        key = _triton_key()
        if key is None:
            return None
        _thread = threading.Thread(target=key, name="ssmspec-triton-key", daemon=True)
        _thread.start()
    return _thread
