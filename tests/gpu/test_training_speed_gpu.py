"""Issue 26's acceptance figures through the real CLI on a GPU (opt in: --run-gpu; about 5 minutes on an H100).

`ssmspec sft --student-preset mamba2-130m` on the Python standard library's sources with a
byte-level BPE of 8192 tokens (both made by recipes/tools/make_corpus.py, as the GPU recipe does),
300 steps of 16 x 512 tokens in bf16, once as a user gets it (`--scan auto`, the compiled and
CUDA-graphed micro-step) and once on the plain-torch path (`--scan ssmspec --no-compile
--no-cuda-graphs`): tokens/s, MFU, wall time and the two loss curves, read back from each run's
log.jsonl. Writes train_speed.json and train_speed.png (the curves side by side) to $OUT when that
is set. The loss curves must agree; the issue's 10x speed is checked last and reported as an
expected failure, with the measured ratio, until it holds.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.requires_cuda
REPO = Path(__file__).resolve().parents[2]


def _make(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "recipes.tools.make_corpus", *args], cwd=REPO, check=True,
                   capture_output=True, timeout=600)


def _sft(work: Path, corpus: Path, tokenizer: Path, name: str, *options: str, steps: int = 300) -> dict:
    """Run `ssmspec sft` and return its start event, step losses, end throughput and wall time."""
    out = work / f"sft-{name}"
    cmd = [sys.executable, "-m", "ssmspec", "sft", "--student-preset", "mamba2-130m", "--data", str(corpus),
           "--tokenizer", str(tokenizer), "--out", str(out), "--overwrite", "--steps", str(steps), "--batch-size", "16",
           "--seq-len", "512", "--lr", "1.5e-3", "--dtype", "bf16", *options, "--eval-every", "0",
           "--no-final-eval", "--save-every", "0", "--log-every", "10"]
    began = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - began
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(line) for line in open(out / "log.jsonl")]
    start = next(e for e in events if e["event"] == "start")
    end = next(e for e in events if e["event"] == "end")
    return {"scan": start["scan"], "step_mode": start["step_mode"], "step_mode_used": end["step_mode"],
            "device": start["device_name"],
            "tokens_per_s": end["throughput"]["tokens_per_s"], "mfu": end["throughput"]["mfu"], "wall_s": wall,
            "command": " ".join(cmd),
            "losses": {e["step"]: e["loss"] for e in events if e["event"] == "step"}}


def _plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("fast", "reference"):
        r = summary[name]
        steps = sorted(r["losses"])
        ax.plot(steps, [r["losses"][s] for s in steps],
                label=f"{name}: {r['scan'].split(':')[0]}, {r['step_mode']} ({r['tokens_per_s']:,.0f} tokens/s)")
    ax.set_xlabel("step (16 x 512 tokens)")
    ax.set_ylabel("training cross-entropy")
    ax.set_title(f"ssmspec sft, mamba2-130m shape, {summary['fast']['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def test_sft_speed_and_loss_curve_fast_vs_plain_torch(tmp_path):
    work = Path(os.environ.get("SSMSPEC_SPEED_WORK", tmp_path))
    _make("corpus", str(work / "corpus"), "--megabytes", "8")
    _make("tokenizer", str(work / "corpus"), str(work / "tokenizer"), "--vocab", "8192")
    fast = _sft(work, work / "corpus", work / "tokenizer", "fast", "--scan", "auto")
    reference = _sft(work, work / "corpus", work / "tokenizer", "reference", "--scan", "ssmspec", "--no-compile",
                     "--no-cuda-graphs")
    speedup = fast["tokens_per_s"] / reference["tokens_per_s"]
    summary = {"fast": fast, "reference": reference, "speedup": speedup}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "train_speed.json").write_text(json.dumps(summary, indent=2))
        try:
            _plot(summary, Path(os.environ["OUT"], "train_speed.png"))
        except ImportError:
            print("matplotlib is not installed: no train_speed.png")
    for name in ("fast", "reference"):
        r = summary[name]
        print(f"{name}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']}, scan {r['scan']}, step {r['step_mode']}, "
              f"wall {r['wall_s']:.0f} s, {r['device']}")
    assert fast["step_mode_used"] == {"mode": "torch.compile + CUDA graph", "graphs_captured": 1}
    assert reference["step_mode_used"] == {"mode": "eager", "graphs_captured": 0}
    assert reference["scan"].startswith("ssmspec:")
    # Same data order, seed and LR: the curves differ only by rounding (scan, fusion order).
    later = [s for s in reference["losses"] if s >= 50]
    worst = max(abs(fast["losses"][s] - reference["losses"][s]) / reference["losses"][s] for s in later)
    assert worst < 0.03, f"loss curves differ by up to {worst:.1%} after step 50"
    if speedup < 10:  # reported, never passed silently
        pytest.xfail(f"the fast path trains at {speedup:.2f}x the plain-torch path's tokens/s (issue 26 asks 10x)")
