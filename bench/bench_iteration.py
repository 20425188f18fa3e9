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

A Transformer target of real shape (transformers' Qwen2 with Qwen2.5-1.5B's config, random
weights; run eagerly, no CUDA graphs: decoding/generate.py `_fast_path`), with tokens per call
given directly (tree spec = value; chain 4 is tree 1,1,1,1), e.g. docs/BENCHMARKS.md's CPU figures:

    python3 bench/bench_iteration.py --presets qwen2.5-1.5b --trees "1,1,1,1;3,2,1" \
        --tokens-per-call "1,1,1,1=1.21;3,2,1=1.41" --out qwen.json

`--presets qwen2-tiny --device cpu` checks that path on the CPU.
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
# transformers Qwen2Config shapes. qwen2.5-1.5b: Qwen/Qwen2.5-1.5B's config.json.
HF_PRESETS = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
                         rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu"),
    "qwen2-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096, tie_word_embeddings=True),
}


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def build_target(preset: str, device: str):
    """A preset target with random weights in bf16 on `device`: ssmspec's own, or a transformers
    Qwen2 wrapped as a TransformersTarget (initialised on `device` directly, seeded)."""
    if preset not in HF_PRESETS:
        return build_model(preset, seed=1, dtype=torch.bfloat16, device=device)
    import transformers

    from ssmspec.models.hf_causal import TransformersTarget

    torch.manual_seed(1)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2Config(**HF_PRESETS[preset]),
                                                           dtype=torch.bfloat16)
    return TransformersTarget(hf.eval())


def timed_calls(target, ids, drafter, cfg, repeats: int, device: str) -> dict:
    """The fastest of `repeats` whole calls after a warm-up call: ms per decode call, prefill ms."""
    engine = Engine(target, drafter)
    engine.generate(ids, cfg)  # compiles kernels, captures graphs
    best = None
    for _ in range(repeats):
        sync(device)
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


def trained_tokens_per_call(path: str | None, given: str | None = None) -> dict[str, float]:
    """tree spec -> tokens per call of every speculative method in an `ssmspec bench` summary.json,
    then those of `given` ("3,2,1=1.41;1,1,1,1=1.21"), which win where both name a tree."""
    tpc = {}
    if path is not None:
        with open(path) as f:
            methods = json.load(f)["methods"]
        tpc = {m["tree"]: m["tokens_per_call"] for m in methods.values() if m.get("tree")}
    for item in filter(None, (given or "").split(";")):
        spec, value = item.split("=")
        tpc[Tree.from_config([int(x) for x in spec.split(",")]).spec()] = float(value)
    return tpc


def run_preset(preset: str, trees: list[Tree], tpc: dict[str, float], prompt_len: int, new_tokens: int,
               repeats: int, device: str) -> list[dict]:
    target = build_target(preset, device)
    drafter = ModelDrafter(build_model("drafter-2l", vocab_size=target.config.vocab_size, seed=2,
                                       dtype=torch.bfloat16, device=device))
    ids = torch.randint(0, target.config.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    ar = timed_calls(target, ids, None, GenerationConfig(method="ar", max_new_tokens=new_tokens), repeats, device)
    rows = [{"preset": preset, "tree": "ar", **ar}]
    print(f"{preset}: ar {ar['ms_per_call']:.3f} ms/token, prefill of {prompt_len} tokens {ar['prefill_ms']:.2f} ms", flush=True)
    for tree in trees:
        cfg = GenerationConfig(method="stree", tree=tree, max_new_tokens=new_tokens)
        row = {"preset": preset, "tree": tree.spec(), "nodes": tree.num_nodes,
               **timed_calls(target, ids, drafter, cfg, repeats, device)}
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
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="mamba2-2.7b,hybrid-8b")
    ap.add_argument("--trees", default=DEFAULT_TREES, help="';'-separated tree configurations")
    ap.add_argument("--summary", default=None, help="a trained pair's `ssmspec bench` summary.json (T=0)")
    ap.add_argument("--tokens-per-call", default=None,
                    help="trained tokens per call, 'tree=value;...' (e.g. '1,1,1,1=1.21;3,2,1=1.41'); over --summary's")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for the tiny presets")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    trees = [Tree.from_config([int(x) for x in spec.split(",")]) for spec in args.trees.split(";")]
    tpc = trained_tokens_per_call(args.summary, args.tokens_per_call)
    rows = []
    for preset in args.presets.split(","):
        rows += run_preset(preset, trees, tpc, args.prompt_len, args.new_tokens, args.repeats, args.device)
    name = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else args.device
    result = {"device": name, "torch": torch.__version__, "summary": args.summary,
              "tokens_per_call": args.tokens_per_call, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
