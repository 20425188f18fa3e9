"""Programmatic dependent launch (PDL) for the decode kernels on Hopper and later.

At batch 1 a decode step is a chain of ~260 launches in which the projections stream weights that
no earlier kernel writes. With PDL a kernel is launched while its predecessor is still running:
each kernel first calls `gdc_launch_dependents` (the next one may start once every program of
this one has started), loads what no earlier kernel writes (weights), then `gdc_wait`s for its
predecessor to finish and flush, and only then reads activations or writes anything. The launch
gap and the ramp of each kernel then overlap the tail of the one before; inside a CUDA graph the
dependency is captured as a programmatic edge.

Rules every PDL kernel here follows: no global write and no read of data another kernel writes
before `gdc_wait` (the cascade of early launches can reach several kernels back).
"""
from __future__ import annotations

import functools

import torch

from .settings import interpreting

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

    _HAVE_GDC = True
except ImportError:  # older Triton: kernels keep USE_PDL False and never reach these names
    gdc_launch_dependents = gdc_wait = None
    _HAVE_GDC = False

@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return _HAVE_GDC and torch.cuda.get_device_capability(index)[0] >= 9


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a Hopper-or-later GPU, not the interpreter."""
    if device.type != "cuda" or interpreting():
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())
