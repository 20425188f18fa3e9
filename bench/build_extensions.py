"""Build the one-launch CUDA extensions (ops/stream_layers, ops/stream_proj) for some shapes in
parallel, so that a GPU session's tests and benchmarks do not each wait about a minute per shape
at first use. torch's loader keeps them under TORCH_EXTENSIONS_DIR for later processes.

Run on the GPU machine from the repository root:

    python3 bench/build_extensions.py --presets mamba2-2.7b --test-shapes
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from ssmspec.models.presets import preset_config  # noqa: E402
from ssmspec.ops import paths  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="mamba2-2.7b", help="comma-separated presets ('' for none)")
    ap.add_argument("--test-shapes", action="store_true", help="also tests/gpu's d_model 256 model")
    args = ap.parse_args()
    from ssmspec.models import LanguageModel

    device = "cuda" if torch.cuda.is_available() else "cpu"  # without CUDA: says why each is skipped
    models = []
    for name in filter(None, args.presets.split(",")):
        # one layer of the preset's shape: the extensions depend on the layer shape only
        cfg = dataclasses.replace(preset_config(name, vocab_size=256), layers=["mamba"])
        models.append(LanguageModel(cfg).to(device, torch.bfloat16).fold_norm_weights_())
    if args.test_shapes:
        from helpers import kernel_shaped_model

        models.append(kernel_shaped_model(("mamba",), device))
    start = time.time()
    skipped = paths.prebuild(models)
    for why in skipped:
        print(f"skipped {why}")
    print(f"built or loaded in {time.time() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
