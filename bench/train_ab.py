"""A/B of training speed between git revisions: whole `ssmspec sft` or `distill` runs, alternating, one machine.

Purpose: measure a training-speed change the way docs/BENCHMARKS.md reports one: each revision's
`ssmspec sft` (or `distill`) as a whole process (compiles, autotuning and the CUDA graph capture included; tokens/s
as its log.jsonl reports them), revisions alternating round by round so drift falls on all of them.
The command is the issue-26 speed test's (tests/gpu/test_training_speed_gpu.py): the mamba2-130m
shape, 16 x 512 tokens a step, bf16, on the stdlib corpus of `recipes/tools/make_corpus`.
Hardware: one GPU (the device tool), with mamba_ssm's sources importable for its training scan.
Expected time: a machine's first run 2-3 min (compiles, autotuning), each later one about 45 s at
200 steps (the caches on disk). Runs drift by a few percent (11-29, H200: one tree's 200-step runs
spanned 244k-259k tokens/s on two machines, 244k-258k in four runs on one of them): each round runs the
revisions in turn, every other round in reverse order (A B, B A, ...), so a drift through the session
and any cost of coming first fall on all of them alike, and the table gives each round's ratio to the
first revision's run of that round besides the medians.
With `--command distill`: drafter-2l distilled from a 130m-shape target (made once, by the first
revision, with 60 steps of sft), 32 x 512 a step, as the speed test's distill_speed runs it.
Usage: python bench/train_ab.py OUT REV [REV ...] [--rounds 2] [--steps 200] [--preset mamba2-130m] [--command distill]
REV: a commit or branch, "." for the working tree, or a directory holding such a tree (`git archive
REV | tar -x -C DIR` made where the history is: the device machine gets a work tree without it). Each
is exported under OUT/src and run as a package of its own (PYTHONPATH, from OUT: never this checkout's); a table is printed last and kept in
OUT/train_ab.json with every run's command.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TARGET_STEPS = 60
"""sft steps of distill's target (the speed test's when it runs alone): its speed does not depend on them."""


def export(rev: str, dest: Path) -> None:
    """The tree of `rev` (the working tree for ".", a directory's files for a directory) as files under dest."""
    if rev != "." and Path(rev).is_dir():
        shutil.copytree(rev, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", ".git"))
        return
    if rev == ".":
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                               capture_output=True, text=True).stdout.split("\n")
        for name in filter(None, files):
            if (REPO / name).is_file():
                (dest / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, dest / name)
        return
    with tempfile.TemporaryFile() as archive:
        subprocess.run(["git", "archive", rev], cwd=REPO, check=True, stdout=archive)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(dest, filter="data")


def package(tree: Path, dest: Path) -> None:
    """The importable package of an exported tree: its directories placed as pyproject's package-dir maps them."""
    mapping = tomllib.loads((tree / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for name in sorted(mapping, key=len):  # parents first: ssmspec, then ssmspec.training into it
        shutil.copytree(tree / mapping[name], dest / name.replace(".", "/"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))


def corpus(work: Path, megabytes: int, vocab: int) -> tuple[Path, Path]:
    """The speed test's corpus (8 MB of the standard library) and its 8192-token tokenizer, made once."""
    data, tokenizer = work / "corpus", work / "tokenizer"
    if not tokenizer.exists():
        make = [sys.executable, "-m", "recipes.tools.make_corpus"]
        subprocess.run([*make, "corpus", str(data), "--megabytes", str(megabytes)], cwd=REPO, check=True,
                       capture_output=True)
        subprocess.run([*make, "tokenizer", str(data), str(tokenizer), "--vocab", str(vocab)], cwd=REPO, check=True,
                       capture_output=True)
    return data, tokenizer


def env_of(pkg: Path) -> dict:
    """This process's environment with pkg first on PYTHONPATH (mamba_ssm's sources, if there, after it)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(pkg), os.environ.get("PYTHONPATH")]))}


def check_imports_from(pkg: Path) -> None:
    """Exit unless `ssmspec` (its training package too) imports from pkg under the runs' PYTHONPATH."""
    found = subprocess.run([sys.executable, "-c", "import ssmspec.training as t; print(t.__file__)"], cwd=pkg,
                           env=env_of(pkg), capture_output=True, text=True).stdout.strip()
    if not found.startswith(str(pkg)):
        sys.exit(f"train_ab: ssmspec imports from {found or 'nowhere'}, not {pkg}")


def train_command(out: Path, data: Path, tokenizer: Path, args, target: Path | None = None) -> list[str]:
    """The timed run: `ssmspec sft` of args.preset, or with a target `ssmspec distill` of
    args.student_preset from it (the speed test's learning rates)."""
    common = [sys.executable, "-m", "ssmspec", "sft" if target is None else "distill", "--out", str(out), "--overwrite",
              "--dtype", "bf16", "--eval-every", "0", "--no-final-eval", "--save-every", "0", "--data", str(data),
              "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
              "--log-every", "10"]
    if target is None:
        return [*common, "--student-preset", args.preset, "--tokenizer", str(tokenizer), "--lr", "1.5e-3", *args.extra]
    return [*common, "--target", str(target), "--student-preset", args.student_preset, "--lr", "3e-3", *args.extra]


def make_target(pkg: Path, work: Path, data: Path, tokenizer: Path, args) -> Path:
    """distill's target: args.preset after TARGET_STEPS of sft (from pkg, the first revision's), made once."""
    target = work / "target"
    if not (target / "config.json").is_file():
        shaped = argparse.Namespace(**{**vars(args), "steps": TARGET_STEPS, "batch_size": 16, "extra": []})
        proc = subprocess.run(train_command(target, data, tokenizer, shaped), cwd=work, env=env_of(pkg),
                              capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"train_ab: the target's sft failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return target


def timed_run(pkg: Path, out: Path, data: Path, tokenizer: Path, args, target: Path | None = None) -> dict:
    """One timed run from pkg; what its log.jsonl says."""
    command = train_command(out, data, tokenizer, args, target)
    out.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(command, cwd=out.parent, env=env_of(pkg), capture_output=True, text=True)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1], "command": command}
    events = [json.loads(line) for line in open(out / "log.jsonl")]
    end = next(e for e in events if e["event"] == "end")
    losses = [e["loss"] for e in events if e["event"] == "step"]
    return {"tokens_per_s": end["throughput"]["tokens_per_s"], "mfu": end["throughput"]["mfu"],
            "peak_memory_gb": end["throughput"].get("peak_memory_gb"), "step_mode": end["step_mode"],
            "last_losses": losses[-3:], "messages": [e["text"] for e in events if e["event"] == "message"],
            "command": command}


def table(runs: list[dict], revs: list[str]) -> str:
    """Each revision's runs (round by round), their median, the median over the first revision's, each
    round's ratio to the first revision's run of the same round, and how many runs captured a CUDA graph."""
    speed = {(r["rev"], r["round"]): r["tokens_per_s"] for r in runs if "tokens_per_s" in r}
    rounds = sorted({r["round"] for r in runs})
    lines = [f"\n{'revision':28s} {'tokens/s (round by round)':36s} {'median':>10s} {'vs first':>9s}  "
             f"{'per round':24s} captured"]
    first = None
    for rev in revs:
        mine = [r for r in runs if r["rev"] == rev and "tokens_per_s" in r]
        speeds = [r["tokens_per_s"] for r in mine]
        median = statistics.median(speeds) if speeds else float("nan")
        first = median if first is None else first
        ratios = [speed[rev, n] / speed[revs[0], n] for n in rounds if (rev, n) in speed and (revs[0], n) in speed]
        captured = sum(r["step_mode"].get("graphs_captured", 0) > 0 for r in mine)
        lines.append(f"{rev:28s} {', '.join(f'{s:,.0f}' for s in speeds):36s} {median:>10,.0f} {median / first:>8.3f}x  "
                     f"{', '.join(f'{q:.3f}' for q in ratios):24s} {captured} of {len(mine)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("revs", nargs="+", help='commits or branches; "." for the working tree')
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--command", choices=("sft", "distill"), default="sft",
                        help=f"distill: --student-preset from a --preset target made by {TARGET_STEPS} steps of sft")
    parser.add_argument("--student-preset", default="drafter-2l", help="distill's student")
    parser.add_argument("--batch-size", type=int, default=None, help="16 for sft, 32 for distill (the speed test's)")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--preset", default="mamba2-130m")
    parser.add_argument("--megabytes", type=int, default=8, help="of corpus")
    parser.add_argument("--vocab", type=int, default=8192, help="tokens of the corpus's tokenizer")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more options of the timed command, last")
    args = parser.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = 16 if args.command == "sft" else 32
    out = args.out.resolve()
    names = {rev: f"{i}-{Path(rev).name if rev != '.' else 'worktree'}" for i, rev in enumerate(args.revs)}
    for rev, name in names.items():
        tree, pkg = out / "src" / name, out / "pkg" / name
        for folder in (tree, pkg):
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        export(rev, tree)
        package(tree, pkg)
        check_imports_from(pkg)
    data, tokenizer = corpus(out / "data", args.megabytes, args.vocab)
    target = None if args.command == "sft" else make_target(out / "pkg" / names[args.revs[0]], out, data, tokenizer, args)
    runs = []
    for round_ in range(1, args.rounds + 1):
        order = list(names.items()) if round_ % 2 else list(names.items())[::-1]
        for rev, name in order:
            result = timed_run(out / "pkg" / name, out / "runs" / f"{name}-{round_}", data, tokenizer, args, target)
            runs.append({"rev": rev, "round": round_, **result})
            shown = result.get("error") or (f"{result['tokens_per_s']:,.0f} tokens/s, {result['step_mode'].get('mode')}, "
                                            f"peak {result['peak_memory_gb'] or 0:.2f} GB")
            print(f"round {round_} {rev}: {shown}", flush=True)
    (out / "train_ab.json").write_text(json.dumps({"args": vars(args) | {"out": str(out)}, "runs": runs}, indent=1,
                                                  default=str))
    print(table(runs, list(names)))
    return 0 if all("tokens_per_s" in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
