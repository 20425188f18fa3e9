#!/usr/bin/env bash
# Self-trained pairs on one GPU, nothing downloaded: a corpus from this machine's Python standard
# library, a BPE tokenizer trained on it, two targets pretrained with `ssmspec sft` (a pure Mamba-2
# at the mamba2-130m shape, and a hybrid Mamba-2 + attention + MLP), a drafter distilled from each,
# then profile, tune-tree and bench on HumanEval at temperature 0 and 1 (a tree tuned for each).
# Purpose: the whole product on trained weights, reproducible on any machine with a GPU.
# Hardware: one CUDA GPU (sized for an H100 80GB; any GPU with 16 GB should do, slower).
# Expected time: about 13 minutes on one H100 80GB (11.5 measured 2026-11-25 with LIMIT=40 on a
# fresh machine and 300 distillation steps, the CUDA extensions' first builds included; each stage
# prints its time); the mamba2 pair alone (PAIRS=mamba2, LIMIT=40, today's 1500 distillation steps)
# spent about 7.5 minutes in its stages on a fresh H100 on 2026-11-28 with mamba_ssm importable and
# the CUDA extensions already built (sft 166 s, distill 187 s, profile 32 s, tune-tree 27 s, benches
# 53 s; first builds add about a minute each; since 11-28 a second tune-tree, at T=1, not yet timed on
# a GPU). Figures in docs/BENCHMARKS.md. The default LIMIT=20 takes a little less.
# Resumable: a rerun skips every stage that finished (a stamp in WORKDIR/.stages and its output),
# so a run cut off (Ctrl-C, a time limit) continues where it stopped; once a stage runs, every
# later stage runs again. Remove WORKDIR to start over.
# The hybrid target is the tiny-hybrid preset (d_model 64): the only hybrid preset small enough to
# pretrain here (hybrid-8b is 8B parameters), so that pair shows the hybrid path end to end, not a
# speedup.
# Usage: bash recipes/gpu_selftrained.sh [WORKDIR]   (default: runs/gpu-selftrained; run from the
#   repository root). Sizes can be changed through the environment, e.g. SFT_STEPS=1000 or
#   DEVICE=cpu DTYPE=fp32 MAMBA_PRESET=tiny DRAFTER_PRESET=tiny CORPUS_MB=1 VOCAB=1024 SFT_STEPS=20
#   DISTILL_STEPS=20 SFT_BATCH=4 DISTILL_BATCH=4 SEQ_LEN=128 LIMIT=2 NEW_TOKENS=32 (a quick check
#   without a GPU: about 2 minutes on 2 CPU cores; the default sizes take hours on a CPU);
#   PAIRS=mamba2 makes and benchmarks only the pure Mamba-2 pair.
# A larger target: PAIRS=mamba2 MAMBA_PRESET=mamba2-1.3b SFT_STEPS=200 SFT_BATCH=4 SFT_ACCUM=4
#   SFT_LR=1e-3 DISTILL_STEPS=500 DISTILL_BATCH=16 (at the 1.3b shape a batch of 8 already runs out
#   of an H100's 80 GB; its sft took 430 s and its distill 223 s there on 2026-11-27, run as these
#   stages' commands; its profile and tune-tree stages were not timed at that size).
# Outputs, all in WORKDIR: corpus/, prompts.jsonl (tuning prompts from stdlib files outside the
# corpus), tokenizer/, and per pair (mamba2/, hybrid/): target/, drafter/, profile/, tune/tree.json (tuned
# at T=0) and tune-t1/tree.json (at T=1), bench-t0/ and bench-t1/ (report.md, summary.json, results.jsonl).
set -euo pipefail

work="${1:-runs/gpu-selftrained}"
python="${PYTHON:-python3}"
corpus_mb="${CORPUS_MB:-8}"
vocab="${VOCAB:-8192}"
sft_steps="${SFT_STEPS:-300}"
distill_steps="${DISTILL_STEPS:-1500}"  # chain 5: 3.17 tokens per call after 300 steps, 3.66 after 600, 3.83-3.86 after 1500 (BENCHMARKS)
sft_batch="${SFT_BATCH:-16}"
sft_accum="${SFT_ACCUM:-1}"
sft_lr="${SFT_LR:-1.5e-3}"
distill_batch="${DISTILL_BATCH:-32}"
seq_len="${SEQ_LEN:-512}"
limit="${LIMIT:-20}"
new_tokens="${NEW_TOKENS:-128}"
device="${DEVICE:-cuda}"
dtype="${DTYPE:-bf16}"
mamba_preset="${MAMBA_PRESET:-mamba2-130m}"
hybrid_preset="${HYBRID_PRESET:-tiny-hybrid}"
drafter_preset="${DRAFTER_PRESET:-drafter-2l}"
hybrid_drafter_preset="${HYBRID_DRAFTER_PRESET:-tiny}"
pairs="${PAIRS:-mamba2 hybrid}"
for name in $pairs; do
  if [ "$name" != mamba2 ] && [ "$name" != hybrid ]; then
    echo "PAIRS: unknown pair '$name' (mamba2, hybrid)" >&2
    exit 2
  fi
done
mkdir -p "$work/.stages"
rerun=0

# stage NAME OUTPUT COMMAND...: run COMMAND unless NAME finished earlier (its stamp and OUTPUT exist,
# and no earlier stage ran again in this invocation).
stage() {
  local name="$1" output="$2"
  shift 2
  if [ "$rerun" = 0 ] && [ -e "$work/.stages/$name" ] && [ -e "$output" ]; then
    echo "   skip: $name finished earlier ($output)"
    return
  fi
  local started=$SECONDS
  "$@"
  touch "$work/.stages/$name"
  echo "   done: $name in $((SECONDS - started)) s"
  rerun=1
}

echo "== corpus: ${corpus_mb} MB of the standard library's Python sources, and tuning prompts from files outside it"
stage corpus "$work/prompts.jsonl" \
  "$python" -m recipes.tools.make_corpus corpus "$work/corpus" --megabytes "$corpus_mb" \
  --prompts "$work/prompts.jsonl" --num-prompts 32

echo "== tokenizer: a byte-level BPE of $vocab tokens trained on the corpus"
stage tokenizer "$work/tokenizer/tokenizer.json" \
  "$python" -m recipes.tools.make_corpus tokenizer "$work/corpus" "$work/tokenizer" --vocab "$vocab"

# tuned DIR T: where a pair's tree tuned at temperature T goes (tune/ at T=0, tune-tT/ otherwise).
tuned() {
  if [ "$2" = 0 ]; then echo "$1/tune"; else echo "$1/tune-t$2"; fi
}

# One pair: pretrain the target, distil its drafter, profile, tune the tree, bench at T=0 and T=1.
pair() {
  local name="$1" target_preset="$2" student_preset="$3" dir="$work/$1"
  mkdir -p "$dir"

  echo "== $name sft: pretrain a $target_preset target on the corpus ($sft_steps steps)"
  stage "$name-sft" "$dir/target/config.json" \
    ssmspec sft --student-preset "$target_preset" --tokenizer "$work/tokenizer" --data "$work/corpus" \
    --out "$dir/target" --overwrite --steps "$sft_steps" --seq-len "$seq_len" --batch-size "$sft_batch" --grad-accum "$sft_accum" --lr "$sft_lr" \
    --eval-every 0 --save-every 0

  echo "== $name distill: a $student_preset drafter from the target ($distill_steps steps)"
  stage "$name-distill" "$dir/drafter/config.json" \
    ssmspec distill --target "$dir/target" --student-preset "$student_preset" --data "$work/corpus" \
    --out "$dir/drafter" --overwrite --steps "$distill_steps" --seq-len "$seq_len" --batch-size "$distill_batch" --lr 3e-3 \
    --eval-every 0 --save-every 0

  echo "== $name profile: call times of target and drafter against input size"
  stage "$name-profile" "$dir/profile/profile.json" \
    ssmspec profile --target "$dir/target" --drafter "$dir/drafter" --dtype "$dtype" --device "$device" \
    --out "$dir/profile" --overwrite

  # One tree per temperature benched: acceptance, and with it the best tree, changes with the temperature.
  for t in 0 1; do
    local tune; tune="$(tuned "$dir" "$t")"
    echo "== $name tune-tree at T=$t: acceptance on the tuning prompts, trees ranked by predicted tokens/s, the best verified"
    stage "$name-${tune##*/}" "$tune/tree.json" \
      ssmspec tune-tree --target "$dir/target" --drafter "$dir/drafter" --prompts "$work/prompts.jsonl" \
      --profile "$dir/profile/profile.json" --budget 32 --temperature "$t" --dtype "$dtype" --device "$device" \
      --out "$tune" --overwrite
  done

  for t in 0 1; do
    local tune; tune="$(tuned "$dir" "$t")"
    echo "== $name bench T=$t: ar, chain 4, the tree tuned at T=$t and 3,2,1 on $limit HumanEval prompts"
    stage "$name-bench-t$t" "$dir/bench-t$t/summary.json" \
      ssmspec bench --target "$dir/target" --drafter "$dir/drafter" --dataset humaneval --methods ar,chain,stree \
      --tree "$tune/tree.json" --tree 3,2,1 --limit "$limit" --max-new-tokens "$new_tokens" \
      --temperature "$t" --dtype "$dtype" --device "$device" --out "$dir/bench-t$t" --overwrite
  done
}

for name in $pairs; do
  if [ "$name" = mamba2 ]; then
    pair mamba2 "$mamba_preset" "$drafter_preset"
  else
    pair hybrid "$hybrid_preset" "$hybrid_drafter_preset"
  fi
done

echo "== results"
for name in $pairs; do
  for t in 0 1; do
    echo "-- $name, T=$t ($work/$name/bench-t$t/report.md)"
    sed -n '/^## Results/,/^## Losslessness/{/^## Losslessness/d;p}' "$work/$name/bench-t$t/report.md"
  done
done
echo "== done: tuned trees in $work/{mamba2,hybrid}/tune{,-t1}/tree.json, benchmarks in $work/{mamba2,hybrid}/bench-t{0,1}/,"
echo "   models in $work/{mamba2,hybrid}/{target,drafter}, corpus and tokenizer in $work"
