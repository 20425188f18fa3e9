"""bench/bench_iteration.py on the CPU (its figures are GPU ones; this keeps the script working):
an ssmspec preset and a transformers Qwen2 target, and the prediction it prints from given tokens per call."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_iteration_times_both_kinds_of_target_and_predicts_from_given_tokens_per_call(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "iteration.json"
    subprocess.run([sys.executable, "bench/bench_iteration.py", "--presets", "qwen2-tiny,tiny", "--device", "cpu",
                    "--trees", "3,2,1;1,1", "--tokens-per-call", "3,2,1=1.41", "--repeats", "1", "--new-tokens", "8",
                    "--prompt-len", "8", "--out", str(out)], cwd=ROOT, check=True, capture_output=True, text=True)
    result = json.loads(out.read_text())
    rows = {(r["preset"], r["tree"]): r for r in result["rows"]}
    assert set(rows) == {(p, t) for p in ("qwen2-tiny", "tiny") for t in ("ar", "3,2,1", "1,1")}
    for preset in ("qwen2-tiny", "tiny"):
        ar, row = rows[preset, "ar"], rows[preset, "3,2,1"]
        assert row["predicted_decode_speedup"] == pytest.approx(1.41 * ar["ms_per_call"] / row["ms_per_call"])
        assert "predicted_decode_speedup" not in rows[preset, "1,1"]  # no tokens per call given for it
    assert result["device"] == "cpu" and result["tokens_per_call"] == "3,2,1=1.41"
