"""Issue 26's acceptance figures through the real CLI on a GPU (opt in: --run-gpu; about 12 minutes on an H100).

All on the Python standard library's sources with a byte-level BPE of 8192 tokens (both made by
recipes/tools/make_corpus.py, as the GPU recipe does), bf16, each figure read back from the run's
log.jsonl and written with its command to $OUT/train_speed*.json when $OUT is set:

- `sft --student-preset mamba2-130m`, 300 steps of 16 x 512, once as a user gets it (`--scan auto`,
  the compiled and CUDA-graphed micro-step) and once on the plain-torch path (`--scan ssmspec
  --no-compile --no-cuda-graphs` with SSMSPEC_BACKEND=reference): tokens/s, MFU, wall time, and the two loss curves, which must
  agree (plotted to $OUT/train_speed.png). The issue asks 10x.
- `distill --student-preset drafter-2l` from that 130m target, the same two ways: the issue asks 5x.
- `sft --student-preset mamba2-1.3b`, 16 x 512 tokens a step: the issue asks 30% MFU.
- `distill` of drafter-2l from a random mamba2-2.7b-shape target at 8 x 2048: tokens/s, MFU, and
  peak memory, which must stay below 60 GB.

A speed the issue asks for and not reached is an expected failure that states the measured figure.
"""

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


def _run(out: Path, command: str, *options: str, timeout: int = 900, plain: bool = False) -> dict:
    """Run `ssmspec COMMAND --out OUT ...` and return what its log.jsonl says (and its wall time);
    plain: every op in plain torch (`SSMSPEC_BACKEND=reference`, besides PLAIN_TORCH's options)."""
    cmd = [sys.executable, "-m", "ssmspec", command, "--out", str(out), "--overwrite", "--dtype", "bf16",
           "--eval-every", "0", "--no-final-eval", "--save-every", "0", *options]
    began = time.perf_counter()
    env = {**os.environ, "SSMSPEC_BACKEND": "reference"} if plain else None
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - began
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(line) for line in open(out / "log.jsonl")]
    start = next(e for e in events if e["event"] == "start")
    end = next(e for e in events if e["event"] == "end")
    return {"scan": start["scan"], "step_mode": start["step_mode"], "step_mode_used": end["step_mode"],
            "device": start["device_name"], "tokens_per_s": end["throughput"]["tokens_per_s"],
            "mfu": end["throughput"]["mfu"], "peak_memory_gb": end["throughput"].get("peak_memory_gb"),
            "wall_s": wall, "command": ("SSMSPEC_BACKEND=reference " if plain else "") + " ".join(cmd),
            "losses": {e["step"]: e["loss"] for e in events if e["event"] == "step"},
            "messages": [e["text"] for e in events if e["event"] == "message"]}


PLAIN_TORCH = ("--scan", "ssmspec", "--no-compile", "--no-cuda-graphs")
"""With `_run(plain=True)`: the issue's baseline, no kernel anywhere (the training conv and the eager
target's conv would otherwise take their Triton kernels on CUDA)."""
FAST = {"mode": "torch.compile + CUDA graph", "graphs_captured": 1}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The corpus and tokenizer every test here trains on (kept under $SSMSPEC_SPEED_WORK when set)."""
    work = Path(os.environ.get("SSMSPEC_SPEED_WORK") or tmp_path_factory.mktemp("speed"))
    if not (work / "tokenizer").is_dir():
        _make("corpus", str(work / "corpus"), "--megabytes", "8")
        _make("tokenizer", str(work / "corpus"), str(work / "tokenizer"), "--vocab", "8192")
    return work


def _sft(work: Path, name: str, *options: str, steps: int = 300, plain: bool = False) -> dict:
    return _run(work / f"sft-{name}", "sft", "--student-preset", "mamba2-130m", "--data", str(work / "corpus"),
                "--tokenizer", str(work / "tokenizer"), "--steps", str(steps), "--batch-size", "16", "--seq-len", "512",
                "--lr", "1.5e-3", "--log-every", "10", *options, plain=plain)


def _write(name: str, summary: dict) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], name).write_text(json.dumps(summary, indent=2))


def _same_curves(fast: dict, reference: dict, after: int, tolerance: float, atol: float = 0.0) -> None:
    """Same data order, seed and LR: the curves differ only by rounding (scan, fusion order).
    atol: for losses that approach 0 (distillation's KL), where a relative gap says little."""
    later = [s for s in reference["losses"] if s >= after]
    worst = max((abs(fast["losses"][s] - reference["losses"][s]) - atol) / reference["losses"][s] for s in later)
    assert worst < tolerance, f"loss curves differ by up to {worst:.1%} (beyond {atol}) after step {after}"


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


def test_sft_speed_and_loss_curve_fast_vs_plain_torch(work):
    fast = _sft(work, "fast", "--scan", "auto")
    reference = _sft(work, "reference", *PLAIN_TORCH, plain=True)
    speedup = fast["tokens_per_s"] / reference["tokens_per_s"]
    summary = {"fast": fast, "reference": reference, "speedup": speedup}
    _write("train_speed.json", summary)
    if os.environ.get("OUT"):
        try:
            _plot(summary, Path(os.environ["OUT"], "train_speed.png"))
        except ImportError:
            print("matplotlib is not installed: no train_speed.png")
    for name in ("fast", "reference"):
        r = summary[name]
        print(f"sft 130m {name}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']}, scan {r['scan']}, "
              f"step {r['step_mode_used']}, wall {r['wall_s']:.0f} s, {r['device']}")
    assert fast["step_mode_used"] == FAST, fast["messages"]
    assert reference["step_mode_used"] == {"mode": "eager", "graphs_captured": 0}
    assert reference["scan"].startswith("ssmspec:")
    _same_curves(fast, reference, after=50, tolerance=0.03)
    if speedup < 10:  # reported, never passed silently
        pytest.xfail(f"the fast path trains at {speedup:.2f}x the plain-torch path's tokens/s (issue 26 asks 10x)")


def _target_130m(work: Path) -> Path:
    """The 130m-shape target the first test trained, or a short one of its own when run alone."""
    target = work / "sft-fast"
    if not (target / "config.json").is_file():
        _sft(work, "fast", "--scan", "auto", steps=60)
    return target


def test_distill_speed_fast_vs_plain_torch(work):
    target = _target_130m(work)

    def distill(name, *options, plain=False):
        return _run(work / f"distill-{name}", "distill", "--target", str(target), "--student-preset", "drafter-2l",
                    "--data", str(work / "corpus"), "--steps", "150", "--batch-size", "32", "--seq-len", "512",
                    "--lr", "3e-3", "--log-every", "10", *options, plain=plain)

    fast, reference = distill("fast"), distill("reference", *PLAIN_TORCH, plain=True)
    speedup = fast["tokens_per_s"] / reference["tokens_per_s"]
    _write("train_speed_distill.json", {"fast": fast, "reference": reference, "speedup": speedup})
    for name, r in (("fast", fast), ("reference", reference)):
        print(f"distill drafter-2l from 130m {name}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']}, "
              f"step {r['step_mode_used']}, wall {r['wall_s']:.0f} s")
    assert fast["step_mode_used"] == FAST, fast["messages"]
    _same_curves(fast, reference, after=50, tolerance=0.05, atol=0.02)
    if speedup < 5:
        pytest.xfail(f"distill's fast path runs at {speedup:.2f}x the plain-torch path's tokens/s (issue 26 asks 5x)")


def test_sft_mfu_at_the_1_3b_shape(work):
    # 16 x 512 tokens a step in one micro-batch (46 GB at its peak): accumulating two of 8 x 512 adds
    # every gradient into .grad twice and casts the weights twice a step (25-28% MFU)
    r = _run(work / "sft-1.3b", "sft", "--student-preset", "mamba2-1.3b", "--data", str(work / "corpus"),
             "--tokenizer", str(work / "tokenizer"), "--steps", "24", "--batch-size", "16",
             "--seq-len", "512", "--lr", "1e-3", "--log-every", "4")
    _write("train_speed_1.3b.json", r)
    print(f"sft 1.3b: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']}, peak {r['peak_memory_gb']:.1f} GB, "
          f"step {r['step_mode_used']}, wall {r['wall_s']:.0f} s")
    assert r["step_mode_used"] == FAST, r["messages"]
    if r["mfu"] < 0.30:
        pytest.xfail(f"sft at the mamba2-1.3b shape reaches {r['mfu']:.1%} MFU (issue 26 asks 30%)")


def test_distill_from_a_2_7b_shape_target_fits_in_60_gb(work):
    target = work / "target-2.7b"
    if not (target / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "ssmspec", "new-model", "--preset", "mamba2-2.7b", "--vocab-from",
                        str(work / "tokenizer"), "--out", str(target), "--dtype", "bf16"], check=True, timeout=600)
    r = _run(work / "distill-2.7b", "distill", "--target", str(target), "--student-preset", "drafter-2l",
             "--data", str(work / "corpus"), "--steps", "12", "--batch-size", "8", "--seq-len", "2048", "--lr", "3e-3",
             "--log-every", "3")
    _write("train_speed_2.7b.json", r)
    print(f"distill drafter-2l from random 2.7b, 8 x 2048: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']}, "
          f"peak {r['peak_memory_gb']:.1f} GB, step {r['step_mode_used']}, wall {r['wall_s']:.0f} s")
    assert r["peak_memory_gb"] < 60
