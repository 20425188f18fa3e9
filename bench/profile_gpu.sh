#!/usr/bin/env bash
# Purpose: the GPU acceptance run of `ssmspec profile` (issue 4): the mamba2-2.7b preset (pure SSM)
# and the hybrid-8b preset (Nemotron-H-8B shape), random weights, bf16, default sizes and methods,
# with the drafter-2l preset for drafter timings. Each profile must finish in under 5 minutes.
# Hardware: one H100 80GB (device tool, kind nvidia-h100-x1). Expected time: ~1-3 min per model.
# Usage: bench/profile_gpu.sh OUT_DIR [extra `ssmspec profile` flags...]
# Writes OUT_DIR/<preset>/profile.json and profile.png, and OUT_DIR/<preset>.log.
set -uo pipefail
out=${1:-${OUT:-bench-out}}
shift || true
mkdir -p "$out"
if ! python3 -c "import ssmspec.cli.profile" 2>/dev/null; then
    python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
status=0
for target in mamba2-2.7b hybrid-8b; do
    start=$SECONDS
    PYTHONUNBUFFERED=1 COLUMNS=140 ssmspec profile --target-preset "$target" --drafter-preset drafter-2l \
        --device cuda --dtype bf16 --out "$out/$target" --overwrite "$@" 2>&1 | tee "$out/$target.log"
    rc=${PIPESTATUS[0]}
    echo "$target: exit $rc, wall $((SECONDS - start)) s" | tee -a "$out/walls.txt"
    [ "$rc" -eq 0 ] || status=$rc
done
exit $status
