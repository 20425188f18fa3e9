"""The one-layer GPU kernel benches off a GPU: they import (their shared `bench/_one_layer.py` from the
script's directory), show their help, and stop with a plain message instead of a traceback."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["chunk_scan_forward_gpu.py", "train_conv_gpu.py"])
def test_a_one_layer_gpu_bench_explains_itself_without_a_gpu(script):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device: the script would run its benchmark")
    run = lambda *a: subprocess.run([sys.executable, f"bench/{script}", *a], cwd=ROOT, capture_output=True,  # noqa: E731
                                    text=True, timeout=120)
    help_ = run("--help")
    assert help_.returncode == 0 and "--rep-ms" in help_.stdout and "--out" in help_.stdout
    refused = run()
    assert refused.returncode == 1 and refused.stderr.strip() == f"{script} needs a CUDA device"
