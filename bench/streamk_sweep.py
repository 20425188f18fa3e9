"""Stream-K skinny GEMM configs of the Mamba projections, timed inside the tree iteration.

For each tree and each projection (in_proj, out_proj), every candidate config (the SKINNY_TUNED /
SKINNY_WIDE tuple with an eighth entry: stream-K programs per SM, ops/gemv/triton
`_skinny_streamk_kernel`) is set, the greedy tree iteration is captured and timed as
bench_decode.py does, and the current table's config is timed right after it, so each ratio is
against a baseline timed seconds apart in the same process. Each candidate's produced tokens must
equal the step-graph greedy chain.

Run on the GPU from the repository root (after `pip install --no-deps -e .`):

    python3 bench/streamk_sweep.py --preset mamba2-2.7b --trees "3,2,1;3,4,2,1"
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_decode import time_tree_iteration  # noqa: E402
from ssmspec.models.presets import build_model  # noqa: E402
from ssmspec.ops import dispatch  # noqa: E402
from ssmspec.ops.gemv import triton as gemv  # noqa: E402
from ssmspec.trees.tree import Tree  # noqa: E402

CANDIDATES = {  # (rows bucket, projection) -> stream-K configs
    ("narrow", "out_proj"): [(16, 256, 2, 4, 0, 1, 1, 1), (16, 256, 2, 6, 0, 1, 1, 1), (16, 256, 4, 8, 0, 1, 1, 1),
                             (32, 256, 2, 4, 0, 1, 1, 1), (16, 256, 2, 4, 0, 1, 1, 2), (16, 128, 2, 8, 0, 1, 1, 2)],
    ("narrow", "in_proj"): [(64, 128, 4, 4, 0, 2, 1, 1), (64, 128, 4, 6, 0, 2, 1, 1), (64, 128, 4, 4, 0, 2, 1, 2),
                            (64, 256, 4, 3, 0, 2, 1, 1), (32, 256, 4, 4, 0, 1, 1, 1)],
    ("wide", "out_proj"): [(16, 256, 4, 4, 0, 1, 1, 1), (32, 256, 4, 4, 0, 1, 1, 1), (32, 256, 4, 3, 0, 1, 1, 2),
                           (16, 256, 4, 3, 0, 1, 1, 2)],
    ("wide", "in_proj"): [(128, 128, 4, 4, 0, 2, 1, 1), (64, 128, 4, 4, 0, 2, 1, 1), (128, 128, 8, 4, 0, 2, 1, 1)],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--trees", default="3,2,1;3,4,2,1")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    model = build_model(args.preset, dtype=torch.bfloat16, device="cuda").fold_norm_weights_()
    dispatch.set_backend("triton")
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 32), device="cuda")
    mixer = model.layers[0].mixer
    shapes = {"in_proj": tuple(mixer.in_proj.weight.shape), "out_proj": tuple(mixer.out_proj.weight.shape)}
    rows = []
    for spec in args.trees.split(";"):
        tree = Tree.from_config(tuple(int(v) for v in spec.split(",")))
        bucket = "narrow" if tree.num_nodes <= gemv.SKINNY_MAX_ROWS else "wide"
        table = gemv.SKINNY_TUNED if bucket == "narrow" else gemv.SKINNY_WIDE
        time_tree_iteration(model, prompt, tree, vocab)  # compile and warm up the current configs
        for proj in ("out_proj", "in_proj"):
            shape = shapes[proj]
            current = table[shape]
            for cfg in CANDIDATES[(bucket, proj)]:
                table[shape] = cfg
                try:
                    info = time_tree_iteration(model, prompt, tree, vocab)
                    ms, ok = info["ms"], info["greedy_chain_matches"]
                except Exception as e:  # a config the compiler or the GPU refuses (e.g. shared memory)
                    ms, ok = float("nan"), f"error: {type(e).__name__}: {str(e)[:80]}"
                table[shape] = current
                ref = time_tree_iteration(model, prompt, tree, vocab)["ms"]
                label = f"{tree.num_nodes} nodes {proj} {cfg}"
                rows.append((label, ms, ref, ok))
                print(f"  {label:<52} {ms:7.3f} ms  current {ref:7.3f}  x{ms / ref:6.3f}  {ok}", flush=True)
    print(f"\n{'config':<56} {'ms':>8} {'current':>8} {'ratio':>7} tokens")
    for label, ms, ref, ok in rows:
        print(f"{label:<56} {ms:8.3f} {ref:8.3f} {ms / ref:7.3f} {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
