#!/usr/bin/env bash
# Purpose: one end-to-end round on a self-trained pair, as users judge speed: the recipe's
# mamba2-130m-shape target and drafter-2l (made on this machine with the CLI), then `ssmspec bench`
# at T=0 and T=1 (the recipe's own), the Mamba drafters paper's trees beside the tuned tree and a
# bandit over them, fp32 losslessness, and the iteration time at the 2.7b / 8b shapes with the
# speedup it predicts (bench/bench_iteration.py), and the prefill by prompt length (bench/bench_prefill.py).
# Hardware: one Hopper GPU (device tool, kind nvidia-h100-x1). Expected time: about 15 minutes on a
# fresh machine (the pair ~10, the benches ~5; 2026-11-27, H100): more than one 10-minute device
# call, so every step is resumable. Run it again with the same WORKDIR (kept under /tmp while the machine stays warm)
# and it continues where it stopped.
# Usage: bench/pair_round.sh OUT_DIR [WORKDIR]   (WORKDIR default /tmp/pair-round)
set -uo pipefail
out=${1:-${OUT:-bench-out}}
work=${2:-/tmp/pair-round}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
# nvcc builds of the one-launch kernels on the CPU while the GPU trains (cached for every later step)
(python3 bench/build_extensions.py --presets mamba2-130m,mamba2-2.7b > "$out/build_extensions.log" 2>&1 &)

step() {  # step NAME OUTPUT COMMAND...: run COMMAND unless OUTPUT exists; log to $out/NAME.log
  local name="$1" output="$2"
  shift 2
  if [ -e "$output" ]; then echo "skip: $name ($output)"; return; fi
  local started=$SECONDS
  "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?, $((SECONDS - started)) s"
}

pair="$work/mamba2"
step recipe "$pair/bench-t1/summary.json" env PAIRS=mamba2 LIMIT=40 bash recipes/gpu_selftrained.sh "$work"
B=(ssmspec bench --target "$pair/target" --drafter "$pair/drafter" --dataset humaneval --max-new-tokens 128)
step paper "$work/paper/summary.json" "${B[@]}" --limit 40 --dtype bf16 --methods ar,stree \
  --tree "$pair/tune/tree.json" --tree 3,3,2,1 --tree 3,2,2,1,1 --tree 2,2,2,1,1,1 \
  --tree "bandit:3,3,2,1;3,2,2,1,1;2,2,2,1,1,1" --out "$work/paper"
step fp32 "$work/fp32/summary.json" "${B[@]}" --limit 40 --dtype fp32 --methods ar,chain,stree \
  --tree 3,2,1 --tree 1,1,1,1,1 --tree "bandit:3,3,2,1;3,2,2,1,1;2,2,2,1,1,1" --out "$work/fp32"
step prefill "$work/prefill.json" python3 bench/bench_prefill.py --presets mamba2-130m,mamba2-2.7b --out "$work/prefill.json"
step iteration "$work/iteration.json" python3 bench/bench_iteration.py --presets mamba2-2.7b,hybrid-8b \
  --summary "$pair/bench-t0/summary.json" --out "$work/iteration.json"

for d in "$pair/bench-t0" "$pair/bench-t1" "$work/paper" "$work/fp32"; do
  [ -f "$d/report.md" ] && { echo "== $d"; sed -n '/^## Results/,/^## Losslessness/{/^## Losslessness/d;p}' "$d/report.md"; }
  [ -f "$d/summary.json" ] && cp "$d/summary.json" "$out/$(basename "$d")-summary.json"
done
[ -f "$work/prefill.json" ] && { cp "$work/prefill.json" "$out/"; tail -4 "$out/prefill.log"; }
[ -f "$work/iteration.json" ] && { cp "$work/iteration.json" "$out/"; tail -14 "$out/iteration.log"; }
grep -E "done:" "$out/recipe.log" 2>/dev/null
