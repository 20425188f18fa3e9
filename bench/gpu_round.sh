#!/usr/bin/env bash
# Purpose: one device-machine round of the GPU fast path (issue 3): the GPU tests, then
# bench_decode.py on mamba2-2.7b (folded and unfolded norms, per-kernel profile) and hybrid-8b.
# Hardware: one H100 80GB (device tool, kind nvidia-h100-x1). Expected time: ~2-7 min, by steps.
# Usage: bench/gpu_round.sh OUT_DIR TAG [steps...]   (steps: tests nl 27b 8b gen train; default tests 27b 8b;
# train:K runs the issue-26 test matching -k K: train:sft_speed train:distill_speed train:1_3b train:2_7b)
set -uo pipefail
out=${1:-${OUT:-bench-out}}
tag=${2:-run}
shift 2 || true
steps=${*:-tests 27b 8b}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
for step in $steps; do
    start=$SECONDS
    case $step in
        train:*) OUT="$out" SSMSPEC_SPEED_WORK=/tmp/ssmspec-speed timeout 590 python3 -m pytest tests/gpu/test_training_speed_gpu.py \
                 -k "${step#train:}" -q -s -rxX --run-gpu -p no:cacheprovider 2>&1 | tail -25 > "$out/train-${step#train:}-$tag.log" ;;
        tests) timeout 300 python3 -m pytest tests/gpu -q --run-gpu -x -p no:cacheprovider 2>&1 | tail -25 > "$out/gpu_tests-$tag.log" ;;
        27b) timeout 300 python3 bench/bench_decode.py --skip-reference --profile --out "$out/bench_decode-$tag.json" \
                 > "$out/bench_decode-$tag.log" 2>&1 ;;
        nl) timeout 200 python3 bench/bench_kernels.py --norm-linear --out "$out/norm_linear-$tag.json" \
                 > "$out/norm_linear-$tag.log" 2>&1 ;;
        gen) timeout 300 python3 bench/bench_generate.py --out "$out/bench_generate-$tag.json" \
                 > "$out/bench_generate-$tag.log" 2>&1 ;;
        8b) timeout 240 python3 bench/bench_decode.py --preset hybrid-8b --skip-reference \
                 --out "$out/bench_decode-hybrid-8b-$tag.json" > "$out/bench_decode-hybrid-8b-$tag.log" 2>&1 ;;
    esac
    echo "$step: exit $?, wall $((SECONDS - start)) s" | tee -a "$out/walls.txt"
done
tail -3 "$out/gpu_tests-$tag.log" 2>/dev/null
[ -f "$out/norm_linear-$tag.log" ] && grep -E "ratio|BAD|checks" "$out/norm_linear-$tag.log"
[ -f "$out/bench_generate-$tag.log" ] && tail -8 "$out/bench_generate-$tag.log"
for f in "$out"/bench_decode*-"$tag".log; do [ -f "$f" ] && { echo "== $f"; sed -n '/weight-read floor/,$p' "$f"; }; done
