#!/usr/bin/env bash
# CPU smoke run of the whole ssmspec pipeline on tiny random models.
# Purpose: show every command working end to end, with no GPU and no downloads.
# Hardware: any CPU (2 cores is enough). Expected time: about a minute.
# Usage: bash recipes/cpu_smoke.sh [WORKDIR]   (default: runs/cpu-smoke)
set -euo pipefail

work="${1:-runs/cpu-smoke}"
mkdir -p "$work"

echo "== 1. a tiny hybrid target and a tiny Mamba-2 drafter (random weights, byte vocabulary)"
ssmspec new-model --preset tiny-hybrid --out "$work/target" --overwrite
ssmspec new-model --preset tiny --seed 1 --out "$work/drafter" --overwrite

echo "== 2. autoregressive baseline, then chain and tree speculation: exactly the same tokens (random tiny models agree rarely, so few drafts are accepted)"
ssmspec generate --target "$work/target" --prompt "The quick brown fox" --max-new-tokens 32 --json > "$work/ar.json"
ssmspec generate --target "$work/target" --prompt "The quick brown fox" --max-new-tokens 32 \
  --drafter "$work/drafter" --method chain --draft-len 4 --json > "$work/chain.json"
ssmspec generate --target "$work/target" --prompt "The quick brown fox" --max-new-tokens 32 \
  --drafter "$work/drafter" --method stree --tree 3,2,1 --json > "$work/stree.json"
ssmspec generate --target "$work/target" --prompt "abc abc abc abc" --max-new-tokens 32 \
  --drafter ngram --tree 2,2,1

echo "== done: outputs in $work"
