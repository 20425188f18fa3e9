"""The recipes run end to end on the CPU: cpu_smoke.sh, and distill_and_tune.sh with its resumption."""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ssmspec.trees import Tree

ROOT = Path(__file__).resolve().parents[1]
HUMANEVAL = "ssmspec/data/humaneval/HumanEval.jsonl.gz"


def run_recipe(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(["bash", *map(str, args)], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_cpu_smoke_recipe(tmp_path):
    proc = run_recipe("recipes/cpu_smoke.sh", tmp_path)
    stages = [line for line in proc.stdout.splitlines() if line.startswith("== ")]
    assert len(stages) == 7 and stages[-1].startswith("== done"), stages
    assert (tmp_path / "drafter" / "config.json").exists()
    profile = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert "fits" in profile and (tmp_path / "profile" / "profile.png").stat().st_size > 0
    tree = json.loads((tmp_path / "tune" / "tree.json").read_text())
    assert tree["mode"] == "static" and "tree" in tree
    ar, tuned = (json.loads((tmp_path / f"{m}.json").read_text()) for m in ("ar", "tuned"))
    assert tuned["token_ids"] == ar["token_ids"] and len(ar["token_ids"]) == 32
    # the tuned tree drove the call (tune-tree may pick a chain on a loaded machine: its timings decide)
    assert tuned["stats"]["method"] in ("chain", "stree") and tuned["stats"]["tree"] == Tree.from_json(tree["tree"]).spec()
    summary = json.loads((tmp_path / "bench" / "summary.json").read_text())
    assert summary["lossless"]["failures"] == 0 and not summary["interrupted"]
    assert {m.split()[0] for m in summary["methods"]} == {"ar", "chain", "stree"}
    assert all(m["prompts"] == 3 for m in summary["methods"].values())
    assert (tmp_path / "bench" / "report.md").exists()


TINY_STAGE_ARGS = {
    "DRAFTER_PRESET": "tiny",
    "DISTILL_ARGS": "--steps 10 --save-every 5 --seq-len 64 --batch-size 4 --text-field prompt "
                    "--eval-num-prompts 1 --eval-max-new-tokens 8",
    "PROFILE_ARGS": "--sizes 1,2,4 --repeats 1 --warmup 0 --prompt-len 16 --device cpu --no-plot",
    "TUNE_ARGS": "--mode static --budget 4 --max-depth 2 --width 2 --max-new-tokens 12 --verify-top 1 --device cpu",
    "BENCH_ARGS": "--limit 2 --max-new-tokens 12 --warmup 0 --draft-len 2 --device cpu",
}
STAGE_OUTPUTS = ("drafter/model.safetensors", "profile/profile.json", "tune/tree.json", "bench/summary.json")


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """One finished run of distill_and_tune.sh against a tiny target: (recipe args, env, work dir, its stdout)."""
    tmp = tmp_path_factory.mktemp("distill_and_tune")
    target, work, prompts = tmp / "target", tmp / "work", tmp / "prompts.txt"
    run_recipe("-c", f"ssmspec new-model --preset tiny-hybrid --out {target}")
    prompts.write_text("def fibonacci(n):\nclass Stack:\n")
    env = {**TINY_STAGE_ARGS, "PROMPTS": str(prompts)}
    recipe = ("recipes/distill_and_tune.sh", target, HUMANEVAL, work)
    return recipe, env, work, run_recipe(*recipe, env=env).stdout


def test_distill_and_tune_recipe_runs_then_skips_every_finished_stage(distilled):
    recipe, env, work, first = distilled
    assert "skip:" not in first and "resume:" not in first
    summary = json.loads((work / "bench" / "summary.json").read_text())
    assert summary["lossless"]["failures"] == 0 and all(m["prompts"] == 2 for m in summary["methods"].values())
    assert "tree" in json.loads((work / "tune" / "tree.json").read_text())
    mtimes = {p: (work / p).stat().st_mtime_ns for p in STAGE_OUTPUTS}

    second = run_recipe(*recipe, env=env)
    skips = re.findall(r"^   skip: (\w[\w-]*) finished earlier", second.stdout, re.M)
    assert skips == ["distill", "profile", "tune-tree", "bench"], second.stdout
    assert {p: (work / p).stat().st_mtime_ns for p in STAGE_OUTPUTS} == mtimes


@pytest.mark.slow
def test_distill_and_tune_recipe_resumes_an_unfinished_distill(distilled):
    # A distill that did not finish (no stamp, checkpoints on disk) continues with --resume, and every
    # later stage runs again on the new drafter.
    recipe, env, work, _ = distilled
    mtimes = {p: (work / p).stat().st_mtime_ns for p in STAGE_OUTPUTS}
    (work / ".stages" / "distill").unlink()
    third = run_recipe(*recipe, env=env)
    assert "resume: continuing the interrupted distill" in third.stdout
    assert "resumed from step" in third.stdout + third.stderr
    assert "skip:" not in third.stdout
    assert all((work / p).stat().st_mtime_ns > mtimes[p] for p in STAGE_OUTPUTS)


SHELL_WORDS = {"set", "echo", "if", "then", "else", "elif", "fi", "for", "do", "done", "local", "shift", "return",
               "exit", "mkdir", "printf", "touch", "rm", "sed", "[", "}", "$@"}


def recipe_commands(text: str) -> list[str]:
    """The program of each command line of a shell script: its first word, or for `stage NAME OUTPUT CMD...`
    the first word of CMD (comments, assignments and function definitions left out)."""
    words = []
    for line in text.replace("\\\n", " ").splitlines():
        parts = shlex.split(line, comments=True)
        if not parts or re.fullmatch(r"[A-Za-z_]+=.*", parts[0]) or parts[0].endswith("()"):
            continue
        words.append(parts[3] if parts[0] == "stage" else parts[0])
    return words


def test_recipes_are_strict_narrated_and_call_only_ssmspec():
    recipes = sorted((ROOT / "recipes").glob("*.sh"))
    assert {r.name for r in recipes} >= {"cpu_smoke.sh", "gpu_selftrained.sh", "distill_and_tune.sh"}
    for recipe in recipes:
        text = recipe.read_text()
        assert "set -euo pipefail" in text, recipe
        header = text.split("set -euo pipefail")[0]
        for field in ("Purpose:", "Hardware:", "Expected time:", "Usage:", "Outputs"):
            assert field in header, (recipe, field)
        assert text.count('echo "== ') >= 4 and 'echo "== done' in text, recipe
        # Every program a recipe runs is ssmspec or a small script of recipes/tools; the rest is shell.
        functions = set(re.findall(r"^(\w+)\(\) \{", text, re.M))
        for word in recipe_commands(text):
            assert word in {"ssmspec", "$python"} | SHELL_WORDS | functions, (recipe, word)
        for line in text.splitlines():
            if '"$python"' in line and not line.lstrip().startswith("#"):
                assert re.search(r'"\$python" -m recipes\.tools\.\w+', line), (recipe, line)


def test_make_corpus_tool_writes_a_corpus_held_out_prompts_and_a_tokenizer(tmp_path):
    tool = [sys.executable, "-m", "recipes.tools.make_corpus"]
    corpus, prompts, tokenizer = tmp_path / "corpus", tmp_path / "prompts.jsonl", tmp_path / "tokenizer"
    subprocess.run([*tool, "corpus", corpus, "--megabytes", "0.3", "--prompts", prompts, "--num-prompts", "4"],
                   cwd=ROOT, check=True, capture_output=True)
    text = "".join(p.read_text() for p in sorted(corpus.glob("*.txt")))
    assert 300_000 <= len(text) < 2_000_000
    records = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert len(records) == 4
    for r in records:
        assert r["prompt"].splitlines()[-1].startswith("def ") and r["prompt"] not in text
    subprocess.run([*tool, "tokenizer", corpus, tokenizer, "--vocab", "300"], cwd=ROOT, check=True, capture_output=True)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer))
    ids = tok("def fibonacci(n):\n    return n")["input_ids"]
    assert len(tok) == 300 and tok.decode(ids) == "def fibonacci(n):\n    return n"
