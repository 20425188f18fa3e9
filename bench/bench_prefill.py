"""Prefill on the GPU: a prompt's chains into a fresh cache, against one AR step of the same model.

Run on a CUDA machine from the repository root (after `pip install --no-deps --no-build-isolation -e .`):

    python bench/bench_prefill.py --presets mamba2-130m,mamba2-2.7b --out prefill.json

For each preset (random weights, bf16, vocabulary 8192 for the small shapes as in the recipe's
pairs): an Engine generation compiles and captures everything first, then the prefill of the
first L tokens of a random prompt (its ChainPrefill graphs, the cache reset outside the timed
region) is timed per length with the profile's harness (profiling/timing.py `time_call`: CUDA
events, median of 40), beside the median AR step (a step graph replay on its own output). Issue 23 asks a 64-token prefill within 1 ms at the 130m shape and within 3 AR steps
at the 2.7b shape.
"""
from __future__ import annotations

import argparse
import json

import torch

from ssmspec.decoding import Engine, GenerationConfig
from ssmspec.decoding.sampling import SamplingParams
from ssmspec.models.presets import build_model
from ssmspec.profiling.timing import time_call

LENGTHS = (2, 16, 64, 130, 256)


def measure(preset: str) -> dict:
    vocab = 8192 if preset in ("mamba2-130m", "drafter-2l") else None
    model = build_model(preset, vocab_size=vocab, seed=1, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model)
    ids = torch.randint(0, model.config.vocab_size, (1, max(LENGTHS)), generator=torch.Generator().manual_seed(0))
    engine.generate(ids[0, :2 * 64 - 1].tolist(), GenerationConfig(method="ar", max_new_tokens=4))  # every chain size
    fast = engine.fast_path
    ids = ids.cuda()
    row = {"preset": preset, "prefill_ms": {}}
    for length in LENGTHS:
        row["prefill_ms"][length] = time_call(lambda n=length: fast.prefill(ids[:, :n]), setup=fast.cache.reset_,
                                              device="cuda", repeats=40).median
    step = fast.step_graph(SamplingParams())
    step.ids.fill_(1)
    row["ar_step_ms"] = time_call(step.advance, device="cuda", repeats=40).median
    row["prefill_64_in_ar_steps"] = row["prefill_ms"][64] / row["ar_step_ms"]
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="mamba2-130m,mamba2-2.7b")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    rows = [measure(p) for p in args.presets.split(",")]
    print(f"{torch.cuda.get_device_name()}; prefill ms by prompt tokens, and one AR step")
    print(f"{'preset':14s}" + "".join(f"{n:>9d}" for n in LENGTHS) + f"{'AR step':>10s}{'64 / step':>11s}")
    for r in rows:
        print(f"{r['preset']:14s}" + "".join(f"{r['prefill_ms'][n]:9.3f}" for n in LENGTHS)
              + f"{r['ar_step_ms']:10.3f}{r['prefill_64_in_ar_steps']:11.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
