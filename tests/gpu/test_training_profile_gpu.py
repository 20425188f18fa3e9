"""Where a training step's time goes on a GPU (opt in: --run-gpu; about a minute on an H100).

The mamba2-130m shape (vocabulary 8192) at 16 x 512 tokens in bf16, through the loop's own
`optimizer_step` (its automatic plan: torch.compile and a CUDA graph on a GPU) on random token data,
with the default scan (`auto`: mamba_ssm's where its sources import) and the plain-torch ones, under torch.profiler: wall time per step, the host's time
to queue a step (no host sync inside one), the GPU's busy time (sum of kernel times), kernel
launches per step and the kernels that take the most time. Read with `-s`; writes
train_profile.json to $OUT when set. Busy close to wall: the GPU's own work bounds the step (then the
top kernels say which); busy far below wall with enqueue close to wall: the host does.
"""
from __future__ import annotations

import json
import os
import random
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.requires_cuda
RESULTS: dict = {}


def _device_time(event) -> float:
    """A profiler event's own device time in us (the attribute's name changed across torch versions)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _run(tmp_path: Path, scan: str, chunk: int, batch: int = 16, seq_len: int = 512, steps: int = 5) -> dict:
    from ssmspec.models.init import init_weights
    from ssmspec.models.lm import LanguageModel
    from ssmspec.models.presets import preset_config
    from ssmspec.training.config import RunConfig
    from ssmspec.training.loop import open_log, optimizer_step, start_run
    from ssmspec.training.scan import training_scan

    vocab = 8192
    data = tmp_path / "tokens.jsonl"
    rng = random.Random(0)
    with open(data, "w") as f:
        for _ in range(24 * batch):
            f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(seq_len + 8)]}) + "\n")
    mcfg = preset_config("mamba2-130m")
    mcfg.vocab_size, mcfg.mamba.chunk_size = vocab, chunk
    student = init_weights(LanguageModel(mcfg), seed=0)
    cfg = RunConfig(mode="sft", out=str(tmp_path / f"out-{scan}-{chunk}"), student_preset="(in memory)", scan=scan)
    cfg.data.spec, cfg.data.seq_len, cfg.data.held_out_fraction = str(data), seq_len, 0.01
    cfg.optim.steps, cfg.optim.batch_size, cfg.optim.precision = 10**6, batch, "bf16"
    cfg.eval.eval_every, cfg.eval.final_eval, cfg.checkpoint.save_every = 0, False, 0
    cfg.checkpoint.log_every = 10**6
    run = start_run(cfg, None, None, student, None)
    with training_scan(cfg.scan, run.device) as picked:
        open_log(run, picked)
        run.model.train()
        for _ in range(3):  # allocator and cuBLAS warm-up
            optimizer_step(run)
        torch.cuda.synchronize()
        start = time.perf_counter()
        enqueue = 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            optimizer_step(run)
            enqueue += time.perf_counter() - t0
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                optimizer_step(run)
            torch.cuda.synchronize()
    kernels, launches = defaultdict(float), 0
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] += _device_time(e)
            launches += e.count
    busy = sum(kernels.values()) / steps / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {"scan": picked.name, "chunk": chunk, "device": torch.cuda.get_device_name(), "tokens_per_step": batch * seq_len,
            "wall_ms": wall * 1e3, "enqueue_ms": enqueue / steps * 1e3, "gpu_busy_ms": busy,
            "launches_per_step": launches / steps, "tokens_per_s": batch * seq_len / wall,
            "top_kernels_ms": [(name[:90], t / steps / 1e3) for name, t in top]}


@pytest.mark.parametrize("scan,chunk", [("auto", 256), ("ssmspec", 256), ("parallel", 256), ("parallel", 64)])
def test_step_time_breakdown(tmp_path, scan, chunk):
    r = _run(tmp_path, scan, chunk)
    RESULTS[f"{scan}-{chunk}"] = r
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "train_profile.json").write_text(json.dumps(RESULTS, indent=2))
    print(f"\n{r['scan']} chunk {chunk} on {r['device']}: {r['tokens_per_s']:,.0f} tokens/s; per step wall "
          f"{r['wall_ms']:.1f} ms, host enqueue {r['enqueue_ms']:.1f} ms, GPU busy {r['gpu_busy_ms']:.1f} ms, "
          f"{r['launches_per_step']:.0f} kernel launches")
    for name, ms in r["top_kernels_ms"]:
        print(f"  {ms:8.2f} ms  {name}")
    assert r["launches_per_step"] > 0 and 0 < r["gpu_busy_ms"] < 1.5 * r["wall_ms"]
