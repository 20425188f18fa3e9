"""Process-wide runtime defaults: how many CPU threads torch uses for decoding."""
from __future__ import annotations

import os

import torch

from .errors import InputError

SMALL_MODEL_PARAMS = 50_000_000
"""Below this many parameters a batch-1 decode step is a few milliseconds of small ops: one
thread runs them without the hand-offs of several, and on a shared machine without waiting for
a busy core at every op (48 tokens of `tiny`: 0.2 s on one thread, 12-27 s on two loaded cores)."""
THREADS_ENV = "SSMSPEC_THREADS"
USER_THREAD_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""Set before start, torch reads these itself: their count is the user's and is kept."""

_STARTUP_THREADS = torch.get_num_threads()
_chosen: int | None = None  # the count this module last set, to tell it from the caller's own


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(num_parameters: int) -> int:
    """One thread for small models; torch's own count, capped at the usable cores, otherwise."""
    if num_parameters < SMALL_MODEL_PARAMS:
        return 1
    return max(1, min(_STARTUP_THREADS, usable_cores()))


def configure_threads(model=None, device=None) -> int:
    """Set torch's CPU thread count for decoding `model` (a LanguageModel) and return the count in use.

    Kept as the user set it: SSMSPEC_THREADS (applied here), OMP_NUM_THREADS or MKL_NUM_THREADS,
    or a torch.set_num_threads call made since ssmspec was imported (a count other than torch's
    count then and the one chosen here). A model on a GPU leaves the count alone.
    """
    global _chosen
    current = torch.get_num_threads()
    from .ops.settings import environment

    settings = environment()
    wanted = settings.threads
    if wanted is not None:
        try:
            count = int(wanted)
        except ValueError:
            count = 0
        if count < 1:
            raise InputError(f"{THREADS_ENV}={wanted!r} must be a positive integer (CPU threads)")
    elif settings.user_thread_env or current not in (_STARTUP_THREADS, _chosen):
        return current
    else:
        device = torch.device(device) if device is not None else getattr(model, "device", torch.device("cpu"))
        if device.type != "cpu":
            return current
        params = sum(p.numel() for p in model.parameters()) if model is not None else 0
        count = default_threads(params)
    if count != current:
        torch.set_num_threads(count)
    _chosen = count
    return count
