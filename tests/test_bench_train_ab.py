"""bench/train_ab.py (the A/B of training speed between revisions) on the CPU at the tiny preset: it
runs each revision from its own exported package, alternating (every other round in reverse order),
and keeps every run's result; its table's ratios, round by round."""
from __future__ import annotations

import importlib.util
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
    assert [(r["rev"], r["round"]) for r in runs] == [(".", 1), ("HEAD", 1), ("HEAD", 2), (".", 2)]
    assert all(r["tokens_per_s"] > 0 and len(r["last_losses"]) > 0 for r in runs)
    for name in ("0-worktree", "1-HEAD"):  # (the script refuses to run a package that does not import first)
        log = (out / "runs" / f"{name}-1.log").read_text()
        assert "error" not in log.lower(), log[-2000:]
        assert (out / "pkg" / name / "ssmspec" / "training" / "scan.py").exists()
    assert "vs first" in proc.stdout and "HEAD" in proc.stdout.splitlines()[-1]


def test_the_table_gives_each_rounds_ratio_to_the_first_revisions_run_of_that_round():
    spec = importlib.util.spec_from_file_location("train_ab", REPO / "bench" / "train_ab.py")
    train_ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_ab)
    graph = {"graphs_captured": 1}
    runs = [{"rev": "A", "round": 1, "tokens_per_s": 200.0, "step_mode": graph},
            {"rev": "B", "round": 1, "tokens_per_s": 220.0, "step_mode": graph},
            {"rev": "B", "round": 2, "tokens_per_s": 180.0, "step_mode": {}},
            {"rev": "A", "round": 2, "tokens_per_s": 150.0, "step_mode": graph},
            {"rev": "B", "round": 3, "error": "exit 1"}]
    rows = {line.split()[0]: line for line in train_ab.table(runs, ["A", "B"]).splitlines()[2:]}
    assert "175" in rows["A"] and "1.000x" in rows["A"] and "2 of 2" in rows["A"]
    assert "1.143x" in rows["B"]  # medians 200 over 175
    assert "1.100, 1.200" in rows["B"] and rows["B"].endswith("1 of 2")  # 220/200, 180/150; round 3 failed


@pytest.mark.slow
def test_distill_runs_from_a_target_made_once(tmp_path):
    out = tmp_path / "ab"
    proc = subprocess.run([sys.executable, "bench/train_ab.py", str(out), ".", "HEAD", "--command", "distill",
                           "--rounds", "1", "--steps", "2", "--preset", "tiny", "--student-preset", "tiny",
                           "--batch-size", "2", "--seq-len", "32", "--megabytes", "1", "--vocab", "256"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads((out / "train_ab.json").read_text())["runs"]
    assert [r["command"][3] for r in runs] == ["distill", "distill"]
    assert all(r["command"][r["command"].index("--target") + 1] == str(out / "target") for r in runs)
    assert (out / "target" / "config.json").is_file() and all(r["tokens_per_s"] > 0 for r in runs)
