"""The code path's settings: the environment, read once, and the scopes that override it.

- the backend: `SSMSPEC_BACKEND` (auto, the default; reference; triton), `set_backend` (the
  CLI's --backend, for the process) or `use_backend(name)` (a `with` block);
- the one-launch CUDA kernels' mode: `SSMSPEC_STREAM_LAYERS` (auto, the default; 1 / on; 0 / off)
  or `use_stream_layers(mode)`;
- TRITON_INTERPRET=1: Triton kernels run on CPU tensors (Triton's interpreter; the tests).

What they mean is ops/paths.py's, which decides the code path from them. This is the only module
of the package that reads the environment (tests/test_architecture.py); the kernels import it
only for `interpreting`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Mapping

from ..errors import CodePathError

BACKENDS = ("auto", "reference", "triton")
BACKEND_ENV = "SSMSPEC_BACKEND"
STREAM_LAYERS_ENV = "SSMSPEC_STREAM_LAYERS"
STREAM_LAYERS_MODES = {"": "auto", "auto": "auto", "1": "on", "on": "on", "0": "off", "off": "off"}


@dataclasses.dataclass(frozen=True)
class Settings:
    """What picks the code path; see the module docstring."""

    backend: str = "auto"
    """auto, reference or triton."""
    stream_layers: str = "auto"
    """The one-launch CUDA kernels' mode: auto, on or off."""
    interpret: bool = False
    """TRITON_INTERPRET=1: Triton kernels run on the CPU."""
    omp_threads: int | None = None
    """OMP_NUM_THREADS when the user set it to a positive integer (CPU thread count), else None."""
    rank: int = 0
    """RANK under torchrun / accelerate (0 for a single process)."""
    threads: str | None = None
    """SSMSPEC_THREADS as given (the CPU thread count for decoding; ssmspec/runtime.py checks it)."""
    user_thread_env: bool = False
    """OMP_NUM_THREADS or MKL_NUM_THREADS set: torch took its thread count from the user."""


def read_settings(environ: Mapping[str, str]) -> Settings:
    """The settings that `environ` asks for; a CodePathError names a value it does not understand."""
    backend = environ.get(BACKEND_ENV, "").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise CodePathError(f"{BACKEND_ENV}={environ[BACKEND_ENV]!r} is not a backend: choose one of "
                            f"{', '.join(BACKENDS)}")
    mode = environ.get(STREAM_LAYERS_ENV, "").strip().lower()
    if mode not in STREAM_LAYERS_MODES:
        raise CodePathError(f"{STREAM_LAYERS_ENV}={environ[STREAM_LAYERS_ENV]!r} is not understood: set it to 1 (on), "
                            "0 (off) or auto (the default, when unset)")
    threads = environ.get("OMP_NUM_THREADS", "").strip()
    rank = environ.get("RANK", "0").strip()
    return Settings(backend, STREAM_LAYERS_MODES[mode], environ.get("TRITON_INTERPRET") == "1",
                    int(threads) if threads.isdigit() and int(threads) > 0 else None,
                    int(rank) if rank.isdigit() else 0, environ.get("SSMSPEC_THREADS"),
                    any(environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")))


@functools.cache
def environment() -> Settings:
    """The settings of this process's environment, read at the first call."""
    return read_settings(os.environ)


_process: Settings | None = None
"""`set_backend`'s settings for the rest of the process, over the environment's."""
_scopes: list[Settings] = []
"""The settings of the `use_backend` / `use_stream_layers` blocks being run, innermost last."""


def settings() -> Settings:
    """The settings in force here: the innermost `use_*` block's, else the process's."""
    if _scopes:
        return _scopes[-1]
    return _process or environment()


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise CodePathError(f"unknown backend {name!r}: choose one of {', '.join(BACKENDS)}")
    return name


def set_backend(name: str) -> None:
    """The backend for the rest of the process (the CLI's --backend); `use_backend` for a block."""
    global _process
    _process = dataclasses.replace(_process or environment(), backend=_check_backend(name))


def get_backend() -> str:
    return settings().backend


@contextlib.contextmanager
def _scope(**changes):
    _scopes.append(dataclasses.replace(settings(), **changes))
    try:
        yield
    finally:
        _scopes.pop()


def use_backend(name: str):
    """`with use_backend("triton"): ...` runs the block on that backend."""
    return _scope(backend=_check_backend(name))


def use_stream_layers(mode: str):
    """`with use_stream_layers("on"): ...` runs the block in that one-launch mode (auto, on, off,
    or the environment's spellings 1 and 0)."""
    if mode not in STREAM_LAYERS_MODES:
        raise CodePathError(f"unknown one-launch mode {mode!r}: choose auto, on (1) or off (0)")
    return _scope(stream_layers=STREAM_LAYERS_MODES[mode])


def stream_layers_mode() -> str:
    return settings().stream_layers


def interpreting() -> bool:
    """Whether Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return settings().interpret
