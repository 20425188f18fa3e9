"""Cold start of the CLI on a GPU (opt in: --run-gpu): after `ssmspec prepare`, a new `ssmspec
generate` process answers within 2 s of its model being loaded (issue 23).

Both processes share the on-disk caches (Triton's kernels, TORCH_EXTENSIONS_DIR's CUDA builds);
what the second still pays is graph capture and the first calls' setup. The generate command's
own stats line gives the time from the loaded model to the last token (`elapsed_s`).
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.requires_cuda


def _cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "ssmspec", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_generate_answers_within_2_s_of_loading_after_prepare(tmp_path):
    from test_loading import make_tokenizer

    # both models share a word-level tokenizer of 8k words (new-model's presets carry none of their own)
    make_tokenizer(8000).save_pretrained(tmp_path / "tok")
    for name, preset in (("target", "mamba2-130m"), ("drafter", "drafter-2l")):
        _cli("new-model", "--preset", preset, "--vocab-from", str(tmp_path / "tok"), "--out", str(tmp_path / name),
             "--dtype", "bf16")
    models = ["--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter")]
    started = time.perf_counter()
    prepared = _cli("prepare", *models, "--tree", "3,2,1")
    print(f"prepare: {time.perf_counter() - started:.1f} s\n{prepared.stdout}")
    started = time.perf_counter()
    out = _cli("generate", *models, "--tree", "3,2,1", "--prompt", " ".join(f"w{i}" for i in range(40)), "--max-new-tokens", "64",
               "--json", timeout=300)
    wall = time.perf_counter() - started
    stats = json.loads(out.stdout)["stats"]
    print(f"generate process: {wall:.1f} s wall, {stats['elapsed_s']:.2f} s from the loaded model to the answer "
          f"(prefill {1000 * stats['prefill_s']:.0f} ms)")
    assert stats["elapsed_s"] < 2.0
