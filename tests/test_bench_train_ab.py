"""bench/train_ab.py (the A/B of training speed between revisions) on the CPU at the tiny preset: it
runs each revision from its own exported package, alternating, and keeps every run's result."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_each_revision_runs_from_its_own_package(tmp_path):
    out = tmp_path / "ab"
    proc = subprocess.run([sys.executable, "bench/train_ab.py", str(out), ".", "HEAD", "--rounds", "2", "--steps", "2",
                           "--preset", "tiny", "--batch-size", "2", "--seq-len", "32", "--megabytes", "1", "--vocab", "256"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((out / "train_ab.json").read_text())["runs"]
    assert [(r["rev"], r["round"]) for r in runs] == [(".", 1), ("HEAD", 1), (".", 2), ("HEAD", 2)]
    assert all(r["tokens_per_s"] > 0 and len(r["last_losses"]) > 0 for r in runs)
    for name in ("0-worktree", "1-HEAD"):  # (the script refuses to run a package that does not import first)
        log = (out / "runs" / f"{name}-1.log").read_text()
        assert "error" not in log.lower(), log[-2000:]
        assert (out / "pkg" / name / "ssmspec" / "training" / "scan.py").exists()
    assert "vs first" in proc.stdout and "HEAD" in proc.stdout.splitlines()[-1]
