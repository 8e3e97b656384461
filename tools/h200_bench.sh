#!/usr/bin/env bash
# One device call for the speed reports (issues 4, 5, 6): kernels, end-to-end, monitored
# bench with NVML, then the bf16 routes a user would otherwise pick. Each part has its own
# time limit so one slow part cannot cost the others; results land in $OUT (<= 8 files).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_bench}
mkdir -p "$OUT/k" "$OUT/e" "$OUT/b" "$OUT/x"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ "${T_KERNELS:-120}" != 0 ]; then  # T_KERNELS=0: the kernel report is already in (a --tune run)
  timeout ${T_KERNELS:-120} python tools/bench_kernels.py --out "$OUT/k" 2>&1 | tail -45
fi
# E2E_CONFIGS: the 2B-shape runtime configurations (``full-nopdl``: Full with plain launches,
# the before/after of programmatic dependent launch); ARTIFACTS: trained artifacts, e.g. add a
# D = 4 export (tools/h200_d4.sh makes the checkpoint; tools/checkpoints/README.md)
ART_ARGS=""
for a in ${ARTIFACTS:-bitmtp_edge/embedded/model}; do ART_ARGS="$ART_ARGS --artifact $a"; done
timeout ${T_E2E:-230} python tools/bench_e2e.py --parts 2b,trained --configs "${E2E_CONFIGS:-full-nopdl,full}" $ART_ARGS \
  --tokens 128 --repeats 2 --prompts 4 --out "$OUT/e" 2>&1 | tail -60
timeout ${T_BENCH:-80} python -m bitmtp_edge.app.cli bench --backend ampere --device cuda --monitor nvml -n 256 \
  --num-prompts 4 --repeats 2 -q --out "$OUT/b" 2>&1 | tail -25
timeout ${T_BASE:-150} python tools/bench_e2e.py --parts baselines --baseline-tokens 32 --out "$OUT/x" 2>&1 | tail -12
tar czf "$OUT/bench_h200.tgz" -C "$OUT" b x
find "$OUT" -maxdepth 2 -type f | sort
