#!/usr/bin/env bash
# CPU smoke run of the whole ssmspec pipeline on tiny models: make a target, distil a drafter from
# it, profile the pair, tune the draft tree, decode with the tuned tree, and benchmark on HumanEval.
# Purpose: show every command working end to end, with no GPU and no downloads (CI runs it).
# Hardware: any CPU (2 cores is enough).
# Expected time: about a minute. Measured 2026-11-25 with OMP_NUM_THREADS=1 on a shared 2-core x86_64
#   machine (load average 4): 62 s wall, 28 s of CPU time.
# Usage: bash recipes/cpu_smoke.sh [WORKDIR]   (default: runs/cpu-smoke; run from the repository root)
# Outputs, all in WORKDIR: target/, drafter/, profile/, tune/tree.json, ar.json and tuned.json
# (generations), bench/ (summary.json, report.md, results.jsonl).
set -euo pipefail

work="${1:-runs/cpu-smoke}"
data="ssmspec/data/humaneval/HumanEval.jsonl.gz"   # vendored prompts (MIT), used here as raw text
prompt='def fibonacci(n):'
mkdir -p "$work"

echo "== 1/6 new-model: a tiny hybrid target (Mamba-2 + attention + MLP, random weights, byte vocabulary)"
ssmspec new-model --preset tiny-hybrid --out "$work/target" --overwrite

echo "== 2/6 distill: a tiny Mamba-2 drafter from it (a few dozen steps: enough to see the KL fall)"
ssmspec distill --target "$work/target" --student-preset tiny --data "$data" --text-field prompt \
  --out "$work/drafter" --overwrite --steps 40 --seq-len 64 --batch-size 8 --lr 3e-3 \
  --eval-every 0 --eval-num-prompts 4 --eval-max-new-tokens 32 --save-every 0

echo "== 3/6 profile: the target's and drafter's call times against input size, and the cost models"
ssmspec profile --target "$work/target" --drafter "$work/drafter" --sizes 1,2,4,8,16 --repeats 3 --warmup 1 \
  --prompt-len 32 --device cpu --out "$work/profile" --overwrite

echo "== 4/6 tune-tree: measure acceptance on a few prompts, rank trees under a small budget, keep the best"
printf '%s\n' "$prompt" 'def is_prime(n):' 'class Stack:' 'def quicksort(xs):' > "$work/prompts.txt"
ssmspec tune-tree --target "$work/target" --drafter "$work/drafter" --prompts "$work/prompts.txt" \
  --profile "$work/profile/profile.json" --mode static --budget 8 --max-depth 3 --width 3 \
  --max-new-tokens 24 --verify-top 2 --device cpu --out "$work/tune" --overwrite

echo "== 5/6 generate: autoregressive, then with the tuned tree: exactly the same tokens"
ssmspec generate --target "$work/target" --prompt "$prompt" --max-new-tokens 32 --device cpu --json > "$work/ar.json"
ssmspec generate --target "$work/target" --prompt "$prompt" --max-new-tokens 32 --device cpu \
  --drafter "$work/drafter" --tree "$work/tune/tree.json" --json > "$work/tuned.json"

echo "== 6/6 bench: ar, chain and the tuned tree on 3 HumanEval prompts (exits 1 on any losslessness failure)"
ssmspec bench --target "$work/target" --drafter "$work/drafter" --dataset humaneval --methods ar,chain,stree \
  --tree "$work/tune/tree.json" --limit 3 --max-new-tokens 32 --warmup 1 --device cpu --out "$work/bench" --overwrite

echo "== done: tuned tree in $work/tune/tree.json, generations in $work/{ar,tuned}.json,"
echo "   benchmark in $work/bench/report.md (summary.json, results.jsonl); models and profile in $work"
