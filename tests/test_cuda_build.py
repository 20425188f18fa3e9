"""ops/cuda_build: a lock left in an extension's build directory by an interrupted build is
removed, one held by a live process is waited for (CPU: torch's loader replaced by a recorder)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ssmspec.ops import cuda_build


@pytest.fixture
def loads(monkeypatch, tmp_path):
    """torch's loader recorded instead of run, its build root in tmp_path."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    calls = []

    def fake_load_inline(name, build_directory, **kwargs):
        calls.append((name, build_directory, os.path.exists(os.path.join(build_directory, "lock")), time.monotonic()))
        return "module"

    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    return calls


def test_a_lock_left_by_an_interrupted_build_is_removed(loads, tmp_path, capsys):
    directory = tmp_path / "ssmspec_ext_1"
    directory.mkdir()
    (directory / "lock").write_text("")  # what torch's loader leaves when killed mid-build
    assert cuda_build.load_inline("ssmspec_ext_1", "a test kernel", cpp_sources="") == "module"
    name, build_directory, lock_seen, _ = loads[0]
    assert (name, build_directory, lock_seen) == ("ssmspec_ext_1", str(directory), False)
    err = capsys.readouterr().err
    assert "loading a test kernel ssmspec_ext_1" in err and "left by an interrupted build" in err


def test_a_first_load_creates_the_directory_and_says_nothing_of_locks(loads, tmp_path, capsys):
    cuda_build.load_inline("ssmspec_ext_2", "a test kernel", cpp_sources="")
    assert loads[0][1] == str(tmp_path / "ssmspec_ext_2") and not loads[0][2]
    assert "interrupted" not in capsys.readouterr().err


def test_a_live_builder_is_waited_for_and_its_lock_kept(loads, tmp_path):
    directory = tmp_path / "ssmspec_ext_3"
    directory.mkdir()
    # another process holds the guard and torch's lock, as a build in progress does, for 1.5 s
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"g = open({str(directory / 'ssmspec.lock')!r}, 'w'); fcntl.flock(g, fcntl.LOCK_EX)\n"
        f"open({str(directory / 'lock')!r}, 'w').close(); print('held', flush=True); time.sleep(1.5)\n"
        f"os.remove({str(directory / 'lock')!r})\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    started = time.monotonic()
    cuda_build.load_inline("ssmspec_ext_3", "a test kernel", cpp_sources="")
    holder.wait(timeout=10)
    assert loads[0][3] - started > 1.0  # waited for the live holder
    assert not loads[0][2]  # which removed its own lock: nothing left to clear
