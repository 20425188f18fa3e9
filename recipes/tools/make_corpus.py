"""Build a training corpus from this machine's Python standard library and train a BPE tokenizer on it.

Nothing is downloaded: the corpus is the stdlib's .py sources (tests left out), written as ~1 MB
.txt parts that `ssmspec sft/distill --data DIR` read; with --prompts, code-completion prompts
(a file's first top-level `def` line and the lines before it) from files left out of the corpus
go to a .jsonl for `ssmspec tune-tree --prompts`. The tokenizer is a byte-level BPE saved as a
transformers tokenizer directory that `ssmspec sft --tokenizer DIR` reads.

Usage:
    python -m recipes.tools.make_corpus corpus OUT_DIR [--megabytes 8] [--prompts FILE.jsonl --num-prompts 32]
    python -m recipes.tools.make_corpus tokenizer CORPUS_DIR OUT_DIR [--vocab 8192]
"""
from __future__ import annotations

import argparse
import json
import sysconfig
from pathlib import Path

PART_CHARS = 1_000_000


def stdlib_sources() -> list[Path]:
    """The standard library's .py files, tests and site-packages left out, sorted (so runs agree)."""
    src = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in src.rglob("*.py") if not {"site-packages", "test", "tests"} & set(p.parts))


def read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def build_corpus(out: Path, megabytes: float) -> tuple[int, list[Path]]:
    """Concatenate stdlib sources into ~1 MB parts up to `megabytes`; returns (characters written, files left out)."""
    files = stdlib_sources()
    out.mkdir(parents=True, exist_ok=True)
    budget, part, buf, buffered, total = int(megabytes * 1e6), 0, [], 0, 0
    for i, f in enumerate(files):
        text = read(f)
        if text is None:
            continue
        buf.append(text)
        buffered += len(text)
        total += len(text)
        if buffered >= PART_CHARS or total >= budget:
            (out / f"part-{part:03d}.txt").write_text("\n".join(buf))
            part, buf, buffered = part + 1, [], 0
        if total >= budget:
            if buf:
                (out / f"part-{part:03d}.txt").write_text("\n".join(buf))
            return total, files[i + 1:]
    if buf:
        (out / f"part-{part:03d}.txt").write_text("\n".join(buf))
    return total, []


def build_prompts(files: list[Path], n: int, out: Path, context_lines: int = 12) -> int:
    """Write up to n prompts {"prompt": ...} to out: each file's first top-level def line and the lines before it."""
    prompts = []
    for f in files:
        lines = (read(f) or "").splitlines()
        at = next((i for i, line in enumerate(lines) if line.startswith("def ") and line.rstrip().endswith(":")), None)
        if at is not None:
            prompts.append("\n".join(lines[max(0, at - context_lines):at + 1]) + "\n")
        if len(prompts) == n:
            break
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return len(prompts)


def build_tokenizer(corpus: Path, vocab: int, out: Path) -> None:
    """Train a byte-level BPE of `vocab` tokens (with <|endoftext|> as end of text) and save it to `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train([str(p) for p in sorted(corpus.glob("*.txt"))], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>").save_pretrained(str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("corpus", help="stdlib sources as .txt parts")
    c.add_argument("out", type=Path)
    c.add_argument("--megabytes", type=float, default=8.0)
    c.add_argument("--prompts", type=Path, help="Also write prompts from files left out of the corpus (.jsonl).")
    c.add_argument("--num-prompts", type=int, default=32)
    t = sub.add_parser("tokenizer", help="a byte-level BPE trained on a corpus directory")
    t.add_argument("corpus", type=Path)
    t.add_argument("out", type=Path)
    t.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    if args.what == "corpus":
        chars, left_out = build_corpus(args.out, args.megabytes)
        print(f"wrote {chars / 1e6:.1f} MB of Python sources to {args.out}")
        if args.prompts:
            n = build_prompts(left_out, args.num_prompts, args.prompts)
            if n == 0:
                raise SystemExit("no stdlib file was left out of the corpus to take prompts from; lower --megabytes")
            print(f"wrote {n} prompts from {len(left_out)} files outside the corpus to {args.prompts}")
    else:
        build_tokenizer(args.corpus, args.vocab, args.out)
        print(f"wrote a {args.vocab}-token byte-level BPE to {args.out}")


if __name__ == "__main__":
    main()
