"""Issue 26's acceptance figures through the real CLI on a GPU (opt in: --run-gpu; about 4 minutes on an H100).

`ssmspec sft --student-preset mamba2-130m` on the Python standard library's sources with a
byte-level BPE of 8192 tokens (both made by recipes/tools/make_corpus.py, as the GPU recipe does),
300 steps of 16 x 512 tokens in bf16, once through the chunk-parallel scan and once through the
plain-torch reference: tokens/s, MFU and the two loss curves, read back from each run's log.jsonl.
Writes train_speed.json to $OUT when that is set. The loss curves must agree; the issue's 10x
speed is checked last and reported as an expected failure, with the measured ratio, until it holds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.requires_cuda
REPO = Path(__file__).resolve().parents[2]


def _make(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "recipes.tools.make_corpus", *args], cwd=REPO, check=True,
                   capture_output=True, timeout=600)


def _sft(work: Path, corpus: Path, tokenizer: Path, scan: str, steps: int = 300) -> dict:
    """Run `ssmspec sft` and return its start event, step losses and end throughput."""
    out = work / f"sft-{scan}"
    cmd = [sys.executable, "-m", "ssmspec", "sft", "--student-preset", "mamba2-130m", "--data", str(corpus),
           "--tokenizer", str(tokenizer), "--out", str(out), "--overwrite", "--steps", str(steps), "--batch-size", "16",
           "--seq-len", "512", "--lr", "1.5e-3", "--dtype", "bf16", "--scan", scan, "--eval-every", "0",
           "--no-final-eval", "--save-every", "0", "--log-every", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(line) for line in open(out / "log.jsonl")]
    start = next(e for e in events if e["event"] == "start")
    end = next(e for e in events if e["event"] == "end")
    return {"scan": start["scan"], "device": start["device_name"], "tokens_per_s": end["throughput"]["tokens_per_s"],
            "mfu": end["throughput"]["mfu"], "command": " ".join(cmd),
            "losses": {e["step"]: e["loss"] for e in events if e["event"] == "step"}}


def test_sft_speed_and_loss_curve_parallel_vs_reference(tmp_path):
    work = Path(os.environ.get("SSMSPEC_SPEED_WORK", tmp_path))
    _make("corpus", str(work / "corpus"), "--megabytes", "8")
    _make("tokenizer", str(work / "corpus"), str(work / "tokenizer"), "--vocab", "8192")
    fast = _sft(work, work / "corpus", work / "tokenizer", "parallel")
    naive = _sft(work, work / "corpus", work / "tokenizer", "ssmspec")
    speedup = fast["tokens_per_s"] / naive["tokens_per_s"]
    summary = {"parallel": fast, "ssmspec": naive, "speedup": speedup}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "train_speed.json").write_text(json.dumps(summary, indent=2))
    for name in ("parallel", "ssmspec"):
        r = summary[name]
        print(f"{name}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']}, scan {r['scan']}, {r['device']}")
    assert "parallel" in fast["scan"] and naive["scan"].startswith("ssmspec:")
    # Same data order, seed and LR: the curves differ only by the scans' rounding.
    later = [s for s in naive["losses"] if s >= 50]
    worst = max(abs(fast["losses"][s] - naive["losses"][s]) / naive["losses"][s] for s in later)
    assert worst < 0.03, f"loss curves differ by up to {worst:.1%} after step 50"
    if speedup < 10:  # reported, never passed silently
        pytest.xfail(f"the parallel scan trains at {speedup:.2f}x the reference's tokens/s (issue 26 asks 10x)")
