"""Issue 26's acceptance figures through the real CLI on a GPU (opt in: --run-gpu; about 6 minutes on an H100).

`ssmspec sft --init-preset mamba2-130m` on the Python standard library's sources (a byte-level
BPE of 8192 tokens trained on them, as bench/distill_gpu.py does), 300 steps of 16 x 512 tokens
in bf16, once through fla's scan and once through the plain-torch one: tokens/s, MFU and the two
loss curves, read back from each run's log.jsonl. Then 30 steps of mamba2-780m (fla, 2 x 2048) for MFU.
Writes train_speed.json to $OUT when that is set. Needs fla-core and einops installed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.requires_cuda


def _corpus(work: Path, megabytes: float = 8.0) -> Path:
    """The stdlib's .py files (sorted, tests left out) as ~1 MB .txt parts."""
    src = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in src.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    out = work / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    parts, buf, total = 0, [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        buf.append(text)
        total += len(text)
        if sum(map(len, buf)) >= 1_000_000 or total >= megabytes * 1e6:
            (out / f"part-{parts:03d}.txt").write_text("\n".join(buf))
            parts, buf = parts + 1, []
        if total >= megabytes * 1e6:
            break
    if buf:
        (out / f"part-{parts:03d}.txt").write_text("\n".join(buf))
    return out


def _tokenizer(corpus: Path, out: Path, vocab: int = 8192) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train([str(p) for p in sorted(corpus.glob("*.txt"))], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>").save_pretrained(str(out))
    return out


def _sft(work: Path, corpus: Path, tokenizer: Path, preset: str, scan: str, steps: int, batch: int, seq_len: int) -> dict:
    """Run `ssmspec sft` and return its log: the start event, the step events and the end event."""
    out = work / f"sft-{preset}-{scan}"
    cmd = [sys.executable, "-m", "ssmspec", "sft", "--init-preset", preset, "--data", str(corpus), "--tokenizer",
           str(tokenizer), "--out", str(out), "--overwrite", "--steps", str(steps), "--batch-size", str(batch),
           "--seq-len", str(seq_len), "--lr", "1.5e-3", "--warmup-steps", str(max(1, steps // 20)), "--precision", "bf16",
           "--scan", scan, "--eval-every", "0", "--save-every", "0", "--log-every", "10"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(line) for line in open(out / "log.jsonl")]
    start = next(e for e in events if e["event"] == "start")
    end = next(e for e in events if e["event"] == "end")
    steps_ = [e for e in events if e["event"] == "step"]
    return {"scan": start["scan"], "device": start["device_name"], "flops_per_token": start["flops_per_token"],
            "tokens_per_s": end["throughput"]["tokens_per_s"], "mfu": end["throughput"]["mfu"],
            "losses": {e["step"]: e["loss"] for e in steps_}, "command": " ".join(cmd)}


def test_sft_speed_and_loss_curve_fla_vs_plain_torch(tmp_path):
    from ssmspec.ops.chunk_scan.fla import fla_refusal

    refused = fla_refusal(torch.device("cuda"))
    if refused:  # reported as xfailed with the reason, never as a pass
        pytest.xfail(refused)
    pytest.importorskip("fla")
    work = Path(os.environ.get("SSMSPEC_SPEED_WORK", tmp_path))
    corpus = _corpus(work)
    tokenizer = _tokenizer(corpus, work / "tokenizer")
    fla = _sft(work, corpus, tokenizer, "mamba2-130m", "fla", 300, 16, 512)
    naive = _sft(work, corpus, tokenizer, "mamba2-130m", "ssmspec", 300, 16, 512)
    big = _sft(work, corpus, tokenizer, "mamba2-780m", "fla", 30, 2, 2048)  # 4k tokens a step fit 80 GB
    summary = {"mamba2-130m fla": fla, "mamba2-130m ssmspec": naive, "mamba2-780m fla": big,
               "speedup": fla["tokens_per_s"] / naive["tokens_per_s"]}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "train_speed.json").write_text(json.dumps(summary, indent=2))
    for name, r in summary.items():
        if isinstance(r, dict):
            print(f"{name}: {r['tokens_per_s']:,.0f} tokens/s, MFU {r['mfu']}, scan {r['scan']}, {r['device']}")
    print(f"speedup {summary['speedup']:.1f}x")
    assert fla["scan"].startswith("fla:") and naive["scan"].startswith("ssmspec:")
    # Same data order, seed and LR: the curves differ only by the scans' rounding.
    later = [s for s in naive["losses"] if s >= 50]
    worst = max(abs(fla["losses"][s] - naive["losses"][s]) / naive["losses"][s] for s in later)
    assert worst < 0.03, f"loss curves differ by up to {worst:.1%} after step 50"
    assert summary["speedup"] >= 10, f"fla is {summary['speedup']:.1f}x the plain-torch tokens/s (issue 26 asks 10x)"
