"""Speculative iteration time per draft tree at large shapes (random weights), and the speedup
it predicts together with a trained pair's tokens per call.

A 2.7B or 8B target cannot be trained on one GPU in a session, but its cost per iteration does
not depend on its weights: this times whole greedy `generate` calls (CUDA graphs, the fused
draft + verify + accept + replay iteration, host included) of a randomly initialised preset
target with a randomly initialised drafter-2l, and of plain AR decoding, in one process. With
random weights about one token is accepted per call, so the time per call is the iteration's
cost (its replay covers a shorter path than a trained pair's: a few microseconds less).

The prediction, labelled as such: a trained pair's tokens per call for the same tree (from an
`ssmspec bench` summary.json, e.g. the 130m pair made by recipes/gpu_selftrained.sh) times
AR's ms per token over the iteration's ms per call (decode only), and end to end with this
shape's measured prefill at the given prompt length and 128 new tokens.

Run on a CUDA machine from the repository root:

    python3 bench/bench_iteration.py --presets mamba2-2.7b,hybrid-8b \
        --summary runs/gpu-selftrained/mamba2/bench-t0/summary.json --out iteration.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ssmspec.decoding import Engine, GenerationConfig, ModelDrafter
from ssmspec.models.presets import build_model
from ssmspec.trees import Tree

DEFAULT_TREES = "1,1,1,1;1,1,1,1,1;3,2,1;3,3,2,1;3,2,2,1,1;2,2,2,1,1,1"


def timed_calls(target, ids, drafter, cfg, repeats: int) -> dict:
    """The fastest of `repeats` whole calls after a warm-up call: ms per decode call, prefill ms."""
    engine = Engine(target, drafter)
    engine.generate(ids, cfg)  # compiles kernels, captures graphs
    best = None
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = engine.generate(ids, cfg)
        elapsed = time.perf_counter() - start
        decode = elapsed - out.stats["prefill_s"]
        row = {"ms_per_call": 1000 * decode / out.stats["target_calls"], "prefill_ms": 1000 * out.stats["prefill_s"],
               "elapsed_ms": 1000 * elapsed, "calls": out.stats["target_calls"],
               "tokens_per_call": out.stats["mean_accepted"]}
        if best is None or row["ms_per_call"] < best["ms_per_call"]:
            best = row
    return best


def trained_tokens_per_call(path: str | None) -> dict[str, float]:
    """tree spec -> tokens per call of every speculative method in an `ssmspec bench` summary.json."""
    if path is None:
        return {}
    with open(path) as f:
        methods = json.load(f)["methods"]
    return {m["tree"]: m["tokens_per_call"] for m in methods.values() if m.get("tree")}


def run_preset(preset: str, trees: list[Tree], tpc: dict[str, float], prompt_len: int, new_tokens: int,
               repeats: int) -> list[dict]:
    target = build_model(preset, seed=1, dtype=torch.bfloat16, device="cuda")
    drafter = ModelDrafter(build_model("drafter-2l", vocab_size=target.config.vocab_size, seed=2,
                                       dtype=torch.bfloat16, device="cuda"))
    ids = torch.randint(0, target.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    ar = timed_calls(target, ids, None, GenerationConfig(method="ar", max_new_tokens=new_tokens), repeats)
    rows = [{"preset": preset, "tree": "ar", **ar}]
    print(f"{preset}: ar {ar['ms_per_call']:.3f} ms/token, prefill of {prompt_len} tokens {ar['prefill_ms']:.2f} ms", flush=True)
    for tree in trees:
        cfg = GenerationConfig(method="stree", tree=tree, max_new_tokens=new_tokens)
        row = {"preset": preset, "tree": tree.spec(), "nodes": tree.num_nodes,
               **timed_calls(target, ids, drafter, cfg, repeats)}
        row["iteration_over_ar_step"] = row["ms_per_call"] / ar["ms_per_call"]
        trained = tpc.get(tree.spec())
        if trained is not None:
            row["trained_tokens_per_call"] = trained
            row["predicted_decode_speedup"] = trained * ar["ms_per_call"] / row["ms_per_call"]
            spec_ms = row["prefill_ms"] + new_tokens / trained * row["ms_per_call"]
            ar_ms = ar["prefill_ms"] + new_tokens * ar["ms_per_call"]
            row["predicted_end_to_end_speedup"] = ar_ms / spec_ms
        rows.append(row)
        print(f"  {tree.spec():12s} {row['ms_per_call']:.3f} ms/iteration = {row['iteration_over_ar_step']:.2f} AR steps"
              + ("" if trained is None else f"; with {trained:.2f} tokens/call: predicted {row['predicted_decode_speedup']:.2f}x "
                 f"decode, {row['predicted_end_to_end_speedup']:.2f}x end to end"), flush=True)
    del target, drafter
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="mamba2-2.7b,hybrid-8b")
    ap.add_argument("--trees", default=DEFAULT_TREES, help="';'-separated tree configurations")
    ap.add_argument("--summary", default=None, help="a trained pair's `ssmspec bench` summary.json (T=0)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    trees = [Tree.from_config([int(x) for x in spec.split(",")]) for spec in args.trees.split(";")]
    tpc = trained_tokens_per_call(args.summary)
    rows = []
    for preset in args.presets.split(","):
        rows += run_preset(preset, trees, tpc, args.prompt_len, args.new_tokens, args.repeats)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "summary": args.summary, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
