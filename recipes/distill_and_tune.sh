#!/usr/bin/env bash
# From a target you have to a tuned, benchmarked drafter: distil a drafter on your data, profile
# the pair, tune the draft tree, bench on HumanEval. Resumable: a rerun skips every finished stage,
# and an interrupted distill continues from its latest checkpoint (--resume).
# Purpose: the path for a real checkpoint (state-spaces/mamba2-2.7b, a Nemotron-H or Granite-4.0-H
#   checkpoint, a transformers causal LM) and the data it should draft well on.
# Hardware: one CUDA GPU for real targets (a 2.7B target in bf16 fits in 24 GB); the CPU for tiny
#   ones (tests/test_recipes.py runs it against a tiny target).
# Expected time: dominated by distill; with the defaults (drafter-2l, 2000 steps) about 30-60
#   minutes on one H100 for a 2.7B target (an estimate, not measured); under a minute for the
#   tiny CPU target of the test.
# Usage: bash recipes/distill_and_tune.sh TARGET_DIR DATA [WORKDIR]   (run from the repository root)
#   DATA: what `ssmspec distill --data` reads (.jsonl/.json/.txt/.parquet files or folders, or a
#   datasets name). WORKDIR defaults to runs/distill-and-tune. The environment adjusts each stage:
#     DRAFTER_PRESET  student preset (default drafter-2l)
#     PROMPTS         tuning prompts for tune-tree (.txt or .jsonl[.gz]; default: the vendored
#                     HumanEval prompts, which bench also uses: set your own domain's prompts)
#     DISTILL_ARGS, PROFILE_ARGS, TUNE_ARGS, BENCH_ARGS   extra flags appended to that stage's
#                     command (a flag given again overrides the default before it), e.g.
#                     DISTILL_ARGS="--steps 500 --text-field prompt" BENCH_ARGS="--limit 20"
#   A stage counts as finished when it exited successfully (a stamp in WORKDIR/.stages) and its
#   output is there; once a stage runs, every later stage runs again (its input changed).
# Outputs, all in WORKDIR: drafter/, profile/profile.json, tune/tree.json, bench/ (report.md,
# summary.json, results.jsonl).
set -euo pipefail

if [ $# -lt 2 ] || [ $# -gt 3 ]; then
  echo "usage: bash recipes/distill_and_tune.sh TARGET_DIR DATA [WORKDIR]" >&2
  exit 2
fi
target="$1"
data="$2"
work="${3:-runs/distill-and-tune}"
drafter_preset="${DRAFTER_PRESET:-drafter-2l}"
prompts="${PROMPTS:-ssmspec/data/humaneval/HumanEval.jsonl.gz}"
stages="$work/.stages"
mkdir -p "$stages"
rerun=0

# finished STAGE OUTPUT: true when STAGE exited successfully earlier, OUTPUT exists and no earlier
# stage ran again in this invocation.
finished() {
  [ "$rerun" = 0 ] && [ -e "$stages/$1" ] && [ -e "$2" ]
}

# ran STAGE: record that STAGE finished; later stages must run again.
ran() {
  touch "$stages/$1"
  rerun=1
}

echo "== 1/4 distill: a $drafter_preset drafter from $target on $data"
if finished distill "$work/drafter/config.json"; then
  echo "   skip: distill finished earlier ($work/drafter)"
else
  if compgen -G "$work/drafter/checkpoints/step-*" > /dev/null; then
    echo "   resume: continuing the interrupted distill from its latest checkpoint"
    start=--resume
  else
    start=--overwrite
  fi
  # shellcheck disable=SC2086  # the *_ARGS variables are flag lists, split on purpose
  ssmspec distill --target "$target" --student-preset "$drafter_preset" --data "$data" --out "$work/drafter" \
    "$start" --steps 2000 --save-every 200 --eval-every 0 ${DISTILL_ARGS:-}
  ran distill
fi

echo "== 2/4 profile: call times of target and drafter against input size, and the cost models"
if finished profile "$work/profile/profile.json"; then
  echo "   skip: profile finished earlier ($work/profile/profile.json)"
else
  # shellcheck disable=SC2086
  ssmspec profile --target "$target" --drafter "$work/drafter" --out "$work/profile" --overwrite ${PROFILE_ARGS:-}
  ran profile
fi

echo "== 3/4 tune-tree: acceptance on $prompts, trees ranked by predicted tokens/s, the best verified"
if finished tune "$work/tune/tree.json"; then
  echo "   skip: tune-tree finished earlier ($work/tune/tree.json)"
else
  # --overwrite replaces only a stale or partial tune of this recipe (tune-tree's own output)
  # shellcheck disable=SC2086
  ssmspec tune-tree --target "$target" --drafter "$work/drafter" --prompts "$prompts" \
    --profile "$work/profile/profile.json" --out "$work/tune" --overwrite ${TUNE_ARGS:-}
  ran tune
fi

echo "== 4/4 bench: ar, chain and the tuned tree on HumanEval (exits 1 on any losslessness failure)"
if finished bench "$work/bench/summary.json"; then
  echo "   skip: bench finished earlier ($work/bench/summary.json)"
else
  # --overwrite replaces only a stale or partial bench of this recipe (bench's own output)
  # shellcheck disable=SC2086
  ssmspec bench --target "$target" --drafter "$work/drafter" --dataset humaneval --methods ar,chain,stree \
    --tree "$work/tune/tree.json" --out "$work/bench" --overwrite ${BENCH_ARGS:-}
  ran bench
fi

echo "== done: drafter in $work/drafter, tuned tree in $work/tune/tree.json,"
echo "   benchmark in $work/bench/report.md (summary.json, results.jsonl), profile in $work/profile"
