"""Distil a 2-layer Mamba-2 drafter on one GPU and compare it with a cross-entropy-only drafter.

Pipeline (all on the machine it runs on, nothing downloaded):
  1. corpus: the Python standard library's .py sources (up to --corpus-mb), as .txt files;
  2. tokenizer: a byte-level BPE of --vocab tokens trained on that corpus;
  3. target: a mamba2-130m-shape model trained briefly on the corpus (`sft --init-preset mamba2-130m`);
  4. drafter A: `distill` of a drafter-2l student from the target (forward KL, T=1);
  5. drafter B: `sft` of a drafter-2l on the same data, same steps, seed and LR (cross-entropy only);
then reports training tokens/s, model-FLOPs utilisation, and the mean tokens per target call of
greedy chain speculative decoding (draft length --draft-len) for the untrained, distilled and
CE-trained drafters, measured by ssmspec.decoding.generate on held-out prompts.

Usage (device tool, one H100):
    python bench/distill_gpu.py --work /tmp/bench --out $OUT
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

H100_BF16_DENSE_TFLOPS = 989.4  # NVIDIA H100 SXM spec sheet, dense bf16 tensor-core peak


def build_corpus(work: Path, megabytes: float) -> Path:
    """Concatenate stdlib .py files (sorted, deterministic) into ~1 MB .txt parts."""
    src = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in src.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    out = work / "corpus"
    out.mkdir(parents=True, exist_ok=True)
    budget, part, buf, total = int(megabytes * 1e6), 0, [], 0
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        buf.append(text)
        total += len(text)
        if sum(map(len, buf)) >= 1_000_000 or total >= budget:
            (out / f"part-{part:03d}.txt").write_text("\n".join(buf))
            part, buf = part + 1, []
        if total >= budget:
            break
    if buf:
        (out / f"part-{part:03d}.txt").write_text("\n".join(buf))
    return out


def build_tokenizer(corpus: Path, vocab: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train([str(p) for p in sorted(corpus.glob("*.txt"))], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")
    tok.save_pretrained(str(out))
    return tok


def matmul_params(model) -> int:
    """Parameters that take part in a matmul per token (every Linear, the LM head included)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def ssd_flops_per_token(cfg) -> int:
    """Forward FLOPs per token of the chunked SSD scan, summed over Mamba layers (as executed, l x l per chunk)."""
    m = cfg.mamba
    per_layer = 2 * m.n_heads * (m.chunk_size * m.d_state + m.chunk_size * m.head_dim + 2 * m.d_state * m.head_dim)
    return per_layer * cfg.layers.count("mamba")


def steady_tps(history: list[dict]) -> float:
    """Median tokens/s over logged windows, the first (compilation, allocator warm-up) left out."""
    values = [h["tokens_per_s"] for h in history[1:]] or [h["tokens_per_s"] for h in history]
    return statistics.median(values)


def run_stage(name: str, cfg, log: list):
    from ssmspec.training.loop import TrainCallbacks, train

    class Print(TrainCallbacks):
        def on_step(self, m):
            print(f"[{name}] step {m['step']} loss {m['loss']:.4f} {m['tokens_per_s']:,.0f} tok/s", flush=True)

        def on_eval(self, m):
            print(f"[{name}] eval {json.dumps({k: v for k, v in m.items() if isinstance(v, (int, float))})}", flush=True)

        def on_message(self, text):
            print(f"[{name}] {text}", flush=True)

    start = time.perf_counter()
    result = train(cfg, Print())
    wall = time.perf_counter() - start
    log.append({"stage": name, "steps": cfg.optim.steps, "wall_s": wall, "info": result.info, "evals": result.evals,
                "final_loss": result.final_loss, "tps": steady_tps(result.history)})
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/ssmspec-bench"))
    ap.add_argument("--out", type=Path, default=None, help="Where bench.json goes (default: --work).")
    ap.add_argument("--corpus-mb", type=float, default=8.0)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--target-steps", type=int, default=300)
    ap.add_argument("--target-batch", type=int, default=16)
    ap.add_argument("--target-lr", type=float, default=1.5e-3)
    ap.add_argument("--drafter-steps", type=int, default=300)
    ap.add_argument("--drafter-batch", type=int, default=32)
    ap.add_argument("--drafter-lr", type=float, default=3e-3)
    ap.add_argument("--draft-len", type=int, default=4)
    ap.add_argument("--eval-prompts", type=int, default=16)
    ap.add_argument("--eval-new-tokens", type=int, default=64)
    ap.add_argument("--target-preset", default="mamba2-130m")
    ap.add_argument("--drafter-preset", default="drafter-2l")
    ap.add_argument("--backend", default="reference", help="ssmspec.ops backend for decoding during evaluation.")
    args = ap.parse_args()

    from ssmspec.models.loading import load_model
    from ssmspec.ops import dispatch
    from ssmspec.training.config import RunConfig

    dispatch.set_backend(args.backend)
    torch.backends.cuda.matmul.allow_tf32 = True
    work = args.work
    if work.exists():
        import shutil

        shutil.rmtree(work)
    work.mkdir(parents=True)
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    stages: list[dict] = []

    t0 = time.perf_counter()
    corpus = build_corpus(work, args.corpus_mb)
    tok = build_tokenizer(corpus, args.vocab, work / "tokenizer")
    print(f"corpus {sum(p.stat().st_size for p in corpus.glob('*.txt')) / 1e6:.1f} MB, tokenizer {len(tok)} tokens, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    def config(mode, out_dir, steps, batch, lr, preset, target=None):
        cfg = RunConfig(mode=mode, out=str(work / out_dir), target=target, student_preset=preset,
                        tokenizer=str(work / "tokenizer"), overwrite=True)
        cfg.data.spec, cfg.data.seq_len, cfg.data.held_out_fraction = str(corpus), args.seq_len, 0.01
        cfg.data.max_held_out_blocks = 64
        cfg.optim.steps, cfg.optim.batch_size, cfg.optim.lr = steps, batch, lr
        cfg.optim.warmup_steps = max(1, steps // 20)
        cfg.optim.precision = "bf16"
        cfg.eval.eval_every = steps if target else 0
        cfg.eval.num_prompts, cfg.eval.prompt_len = args.eval_prompts, min(64, args.seq_len // 2)
        cfg.eval.max_new_tokens, cfg.eval.draft_len = args.eval_new_tokens, args.draft_len
        cfg.checkpoint.save_every, cfg.checkpoint.log_every = 0, max(1, steps // 10)
        return cfg

    run_stage("target", config("sft", "target", args.target_steps, args.target_batch, args.target_lr, args.target_preset), stages)
    target_dir = str(work / "target")
    distill_cfg = config("distill", "distilled", args.drafter_steps, args.drafter_batch, args.drafter_lr, args.drafter_preset, target_dir)
    run_stage("distill", distill_cfg, stages)
    ce_cfg = config("sft", "ce", args.drafter_steps, args.drafter_batch, args.drafter_lr, args.drafter_preset, target_dir)
    run_stage("ce", ce_cfg, stages)

    # FLOPs per trained token: 6x (forward + backward) for the student, 2x for the frozen target's forward.
    target_model = load_model(target_dir).model
    drafter_model = load_model(str(work / "distilled")).model
    t_fwd = 2 * matmul_params(target_model) + ssd_flops_per_token(target_model.config)
    d_fwd = 2 * matmul_params(drafter_model) + ssd_flops_per_token(drafter_model.config)
    flops = {"target": 3 * t_fwd, "distill": 3 * d_fwd + t_fwd, "ce": 3 * d_fwd}
    for s in stages:
        s["flops_per_token"] = flops[s["stage"]]
        s["tflops"] = s["tps"] * flops[s["stage"]] / 1e12
        s["mfu_vs_989"] = s["tflops"] / H100_BF16_DENSE_TFLOPS
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "python": platform.python_version(), "args": {k: str(v) for k, v in vars(args).items()},
        "target_params": sum(p.numel() for p in target_model.parameters()),
        "drafter_params": sum(p.numel() for p in drafter_model.parameters()),
        "stages": stages,
    }
    (out / "bench.json").write_text(json.dumps(summary, indent=2, default=str))
    print("\n| stage | steps | tokens/s | TFLOP/s | MFU (989 peak) | final loss | wall s |")
    print("|---|---|---|---|---|---|---|")
    for s in stages:
        print(f"| {s['stage']} | {s['steps']} "
              f"| {s['tps']:,.0f} | {s['tflops']:.1f} | {100 * s['mfu_vs_989']:.1f}% | {s['final_loss']:.4f} | {s['wall_s']:.0f} |")
    print("\n| drafter | tokens per target call (chain k=%d, greedy) | held-out KL to target | top-1 agreement |" % args.draft_len)
    print("|---|---|---|---|")
    dist, ce = stages[1]["evals"], stages[2]["evals"]
    rows = [("untrained", dist[0]), ("distilled (KL)", dist[-1]), ("CE only", ce[-1])]
    for name, e in rows:
        print(f"| {name} | {e.get('mean_accepted', float('nan')):.3f} | {e.get('held_out_kl', float('nan')):.3f} | "
              f"{e.get('agreement', float('nan')):.3f} |")
    print(f"\nscan: {stages[0]['info']['scan']}; total {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
