"""Test options: slow and GPU tests are opt-in; CPU fp32 tests always run."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The suite runs many tiny models; on a shared 2-core CI machine several threads per op only
# wait for each other (ssmspec/runtime.py). One thread here and in the commands the tests spawn,
# unless the caller chose a count.
if not any(os.environ.get(name) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "SSMSPEC_THREADS")):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")
    parser.addoption("--run-gpu", action="store_true", help="run tests marked requires_cuda (needs a GPU)")


RUN_SLOW_ENV = "SSMSPEC_RUN_SLOW"
"""Set under --run-slow, so that child pytest runs (helpers.run_interpreted) run their slow tests too."""


def pytest_configure(config):
    if config.getoption("--run-slow"):
        os.environ[RUN_SLOW_ENV] = "1"


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--run-slow") or os.environ.get(RUN_SLOW_ENV) == "1"
    run_gpu = config.getoption("--run-gpu")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow: opt in with --run-slow"))
        if "requires_cuda" in item.keywords:
            if not run_gpu:
                item.add_marker(pytest.mark.skip(reason="GPU test: opt in with --run-gpu on a CUDA machine"))
            elif not torch.cuda.is_available():
                # Asked for GPU tests on a machine without one: fail loudly rather than pass silently.
                item.add_marker(pytest.mark.xfail(reason="--run-gpu given but CUDA is unavailable", run=False, strict=True))


def pytest_collection_finish(session):
    """Start the interpreted kernel tests' child run now, beside the rest of the suite (helpers.run_interpreted)."""
    if os.environ.get("TRITON_INTERPRET") == "1" or session.config.option.collectonly:
        return
    import helpers

    files = sorted({Path(str(item.fspath)).resolve().relative_to(helpers.REPO).as_posix() for item in session.items
                    if item.name.endswith(helpers.INTERPRETED_TEST_SUFFIXES) and not item.get_closest_marker("skip")})
    if files:
        helpers.start_interpreted(files)


def pytest_sessionfinish(session):
    import helpers

    helpers.stop_interpreted()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _programs_write_apart(monkeypatch):
    """Under Triton's interpreter (the kernel tests' child runs): no two programs of a launch may
    store to one element (helpers.check_programs_write_apart)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    import helpers

    last_check = helpers.check_programs_write_apart(monkeypatch)
    yield
    last_check()


@pytest.fixture
def nan_outputs(monkeypatch):
    """Outputs that the kernels allocate start as NaN, so an unwritten lane fails assert_close."""
    empty, empty_like = torch.empty, torch.empty_like

    def nan_fill(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: nan_fill(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: nan_fill(empty_like(*a, **k)))


@pytest.fixture
def triton_backend():
    """The Triton kernels only for the test (GPU tests comparing another kernel path with them):
    the one-launch CUDA kernels off until the test asks for them (`paths.use_stream_layers("on")`)."""
    from ssmspec.ops import paths

    with paths.use_backend("triton"), paths.use_stream_layers("off"):
        yield
