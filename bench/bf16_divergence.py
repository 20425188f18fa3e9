"""Where greedy speculative decoding in bf16 leaves the AR ids, and whether that is a near tie.

In fp32 every method produces the eager AR ids (bench_generate.py part 1, tests/gpu). In bf16 the
AR step and the tree verify are different kernels (one row against a tree of rows; on Hopper the
one-launch CUDA kernels, elsewhere Triton) whose logits differ by rounding, so where the target's
two best tokens are nearly tied the two paths may take different ones; the outputs then part.
This finds the first position where `generate`'s ar (graphs) and stree ids part, for the default
mode and the Triton-only mode (SSMSPEC_STREAM_LAYERS=0), and judges each parting against the
target's logits in fp32 (the same bf16 weights, converted, through the reference ops): the gap
between the two tokens there, against the fp32 logits' gap to the third and the bf16 spacing.

    python3 bench/bf16_divergence.py --preset mamba2-2.7b --new-tokens 128
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from ssmspec.decoding import GenerationConfig, ModelDrafter, generate
from ssmspec.models.presets import build_model
from ssmspec.ops import paths
from ssmspec.trees import Tree


def fp32_logits(reference, ids: list[int]) -> torch.Tensor:
    """The next-token logits after `ids`, fp32 weights and activations, reference ops."""
    with paths.use_backend("reference"), torch.no_grad():
        return reference(torch.tensor([ids], device=reference.device), last_only=True)[0, -1].double()


def divergences(target, reference, prompts, cases, new_tokens: int, mode: str) -> list[dict]:
    """For each prompt and tree: where stree's ids first part from ar's, judged by the fp32 logits."""
    rows = []
    for p, prompt in enumerate(prompts):
        ar = generate(target, prompt, config=GenerationConfig(method="ar", max_new_tokens=new_tokens)).token_ids
        for name, tree in cases:
            out = generate(target, prompt, drafter=ModelDrafter(target),
                           config=GenerationConfig(method="stree", tree=tree, max_new_tokens=new_tokens))
            ids = out.token_ids
            k = next((i for i, (a, b) in enumerate(zip(ids, ar)) if a != b), None)
            row = {"mode": mode, "prompt": p, "case": name, "same_for": len(ar) if k is None else k,
                   "accepted_per_call": out.stats["mean_accepted"]}
            if k is not None:
                logits = fp32_logits(reference, prompt + ar[:k])
                top = logits.topk(3)
                a, s = ar[k], ids[k]
                spacing = 2.0 ** (torch.floor(torch.log2(top.values[0].abs())).item() - 7)  # bf16 at the top logit
                row.update(ar_token=a, stree_token=s, gap=float(logits[a] - logits[s]),
                           both_top2=bool({a, s} <= set(top.indices[:2].tolist())),
                           gap_to_third=float(top.values[1] - top.values[2]), bf16_spacing=spacing)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="mamba2-2.7b")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run at a tiny preset")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # The same bf16 weights folded as generate folds them (the function the kernels compute), in fp32.
    reference = build_model(args.preset, seed=1, dtype=torch.bfloat16, device=args.device).fold_norm_weights_().float()
    gen = torch.Generator().manual_seed(0)
    vocab = min(50000, reference.config.vocab_size)
    prompts = [torch.randint(0, vocab, (64,), generator=gen).tolist() for _ in range(args.prompts)]
    cases = [("stree 3,2,1, self-draft", Tree.from_config((3, 2, 1))), ("stree 2,1, self-draft", Tree.from_config((2, 1)))]
    rows = []
    for mode in ("auto", "0"):
        # A fresh target per mode: generate keeps the CUDA graphs it captured with the model, and
        # graphs captured in one mode would replay that mode's kernels in the other.
        target = build_model(args.preset, seed=1, dtype=torch.bfloat16, device=args.device)
        with paths.use_stream_layers(mode):
            rows += divergences(target, reference, prompts, cases, args.new_tokens, mode)
        del target
        torch.cuda.empty_cache()
    print(f"\n{'mode':<5} {'prompt':>6} {'case':<24} {'same for':>8} {'fp32 gap a-s':>13} {'bf16 spacing':>13} "
          f"{'2nd-3rd gap':>12} {'both top 2':>10}")
    for r in rows:
        if "gap" in r:
            print(f"{r['mode']:<5} {r['prompt']:>6} {r['case']:<24} {r['same_for']:>8} {r['gap']:13.5f} "
                  f"{r['bf16_spacing']:13.5f} {r['gap_to_third']:12.5f} {str(r['both_top2']):>10}")
        else:
            print(f"{r['mode']:<5} {r['prompt']:>6} {r['case']:<24} {r['same_for']:>8}  (the whole output)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
