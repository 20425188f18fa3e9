"""What the one-layer GPU kernel benches (`chunk_scan_forward_gpu.py`, `train_conv_gpu.py`) share:
their command line, their timing and the rows file they write."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def parse_args(doc: str, script: str) -> argparse.Namespace:
    """--rep-ms and --out; exits with a message where there is no CUDA device."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--rep-ms", type=int, default=100, help="Milliseconds of repeats per timing (triton.testing).")
    ap.add_argument("--out", type=Path, default=None, help="Where the rows go as JSON.")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit(f"{script} needs a CUDA device")
    return args


def write_rows(out: Path | None, rows: list) -> None:
    """The rows as JSON with the device and torch version, when --out was given."""
    if out:
        out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows},
                                  indent=1))


def replayed(fn, rep_ms: int) -> float:
    """Median ms of CUDA-graph replays of fn (triton.testing), after one call (compiles, autotuning)."""
    from triton.testing import do_bench_cudagraph

    fn()
    return do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
