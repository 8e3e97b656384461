#!/usr/bin/env bash
# One device call for issue 15 (W2A8 at a Jetson's bandwidth): the per-launch floor, the
# large-matrix throughput and the whole-stack benchmark (schemes side by side, the Orin
# projection), optionally the sweep that writes this GPU's table, then the GPU kernel tests.
# Each part has its own limit; results land in $OUT/k: kernels.json, kernels.md, bench.log,
# pytest.log, smi.txt (and <gpu>.json, the tuned table, with SWEEP=1).
#   T_BENCH=200 T_TESTS=0 ONLY=floor,large,stack bash tools/h200_kernels.sh
#   SWEEP=1 ONLY=floor,large,stack,quant,heads STACK_WIDTHS=1,2,5,9,16,27,40,80 \
#     SCHEMES="before (tuned table),v1 untuned,v1 untuned+pf,v3 untuned,v3 untuned+co,tuned+co" T_TESTS=60 ...
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_kernels}
mkdir -p "$OUT/k"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm --format=csv | tee "$OUT/k/smi.txt"
EXTRA=()
[ "${SWEEP:-0}" = 1 ] && EXTRA+=(--sweep)
[ -n "${SCHEMES:-}" ] && EXTRA+=(--stack-schemes "$SCHEMES")
timeout -k 5 ${T_BENCH:-200} python tools/bench_kernels.py --only "${ONLY:-floor,large,stack}" --widths 1,16 \
  --stack-models "${STACK_MODELS:-bitnet-2b}" --stack-widths "${STACK_WIDTHS:-1,2,9,16,27,40,80}" --replays 5 \
  --jobs 14 "${EXTRA[@]}" --out "$OUT/k" 2>&1 \
  | tee "$OUT/k/bench.log" | grep -E "floor|large|stack |precompiled|FAIL|rror|rmsnorm|relu2|head" | cut -c1-150 | tail -150
if [ "${T_TESTS:-0}" -gt 0 ]; then
  timeout -k 3 "$T_TESTS" python -m pytest -q -x -m gpu -p no:cacheprovider tests/test_kernels_linear.py \
    > "$OUT/k/pytest.log" 2>&1
  tail -12 "$OUT/k/pytest.log" | cut -c1-400
fi
find "$OUT" -maxdepth 2 -type f | sort
