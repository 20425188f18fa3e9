#!/usr/bin/env bash
# CPU smoke run of the whole ssmspec pipeline on tiny models: make a target, distil a drafter from
# it, profile the target, then decode with and without speculation.
# Purpose: show every command working end to end, with no GPU and no downloads.
# Hardware: any CPU (2 cores is enough). Expected time: about two minutes.
# Usage: bash recipes/cpu_smoke.sh [WORKDIR]   (default: runs/cpu-smoke; run from the repository root)
set -euo pipefail

work="${1:-runs/cpu-smoke}"
data="ssmspec/data/humaneval/HumanEval.jsonl.gz"   # vendored prompts (MIT), used here as raw text
mkdir -p "$work"

echo "== 1. a tiny hybrid target (Mamba-2 + attention + MLP, random weights, byte vocabulary)"
ssmspec new-model --preset tiny-hybrid --out "$work/target" --overwrite

echo "== 2. distil a tiny Mamba-2 drafter from it (a few dozen steps: enough to see the KL fall)"
ssmspec distill --target "$work/target" --student-preset tiny --data "$data" --text-field prompt \
  --out "$work/drafter" --overwrite --steps 40 --seq-len 64 --batch-size 8 --lr 3e-3 \
  --eval-every 0 --save-every 0

echo "== 3. profile the target's call time against input size, fit the cost models"
ssmspec profile --target "$work/target" --sizes 1,2,4,8,16 --repeats 3 --warmup 1 --prompt-len 32 \
  --device cpu --out "$work/profile" --overwrite

echo "== 4. autoregressive baseline, then chain and tree speculation: exactly the same tokens"
prompt='def fibonacci(n):'
ssmspec generate --target "$work/target" --prompt "$prompt" --max-new-tokens 48 --json > "$work/ar.json"
ssmspec generate --target "$work/target" --prompt "$prompt" --max-new-tokens 48 \
  --drafter "$work/drafter" --method chain --draft-len 4 --json > "$work/chain.json"
ssmspec generate --target "$work/target" --prompt "$prompt" --max-new-tokens 48 \
  --drafter "$work/drafter" --method stree --tree 3,2,1 --json > "$work/stree.json"
ssmspec generate --target "$work/target" --prompt "$prompt" --max-new-tokens 48 \
  --drafter "$work/drafter" --tree 3,2,1

echo "== done: models, profile/profile.json, profile/profile.png and generations in $work"
