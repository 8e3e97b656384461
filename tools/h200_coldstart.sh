#!/usr/bin/env bash
# One device call for issue 16 item 3 (cold start), about 150 s: the BitNet-2B shape's
# startup cold with the kernel precompile pass (threads), warm without the pass on the
# kernels it compiled (tokens and binaries as without it), cold with worker processes, warm
# with the pass (tools/bench_startup.py: a fresh process and Triton cache folder per load,
# each load time-limited, the whole run within BUDGET seconds). Results land in $OUT/coldstart.
#   ARTIFACT=DIR   use this artifact instead of building the 2B shape (a CPU dry run: any test artifact);
#                  by default an artifact a previous call left in $WORK is reused
#   BEFORE=DIR     also time a cold start with the pass of the checkout in DIR (before/after, one run)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_coldstart}
mkdir -p "$OUT/coldstart"
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python -c "import os, torch, triton; from triton.runtime import _async_compile; print('torch', torch.__version__, \
'triton', triton.__version__, 'AsyncCompileMode', hasattr(_async_compile, 'AsyncCompileMode'), 'cpus', os.cpu_count())"
} 2>&1 | tee "$OUT/coldstart/env.txt"
WORK=${WORK:-/tmp/bitmtp-startup}
if [ -z "${ARTIFACT:-}" ] && [ -f "$WORK/bitnet2b-artifact/manifest.json" ]; then ARTIFACT=$WORK/bitnet2b-artifact; fi
timeout ${T_TOTAL:-165} python tools/bench_startup.py --modes ${MODES:-cold-on,warm-off-on,cold-proc,warm-on} \
  --budget ${BUDGET:-148} --timeout ${T_LOAD:-55} --tokens ${TOKENS:-16} --work "$WORK" \
  ${ARTIFACT:+--artifact "$ARTIFACT"} --out "$OUT/coldstart" 2>&1 | tee "$OUT/coldstart/log.txt" | tail -40
if [ -n "${BEFORE:-}" ]; then
  ARTIFACT=${ARTIFACT:-$WORK/bitnet2b-artifact}
  mkdir -p "$OUT/coldstart/before"
  (cd "$BEFORE" && PYTHONPATH=. timeout ${T_BEFORE:-50} python tools/bench_startup.py --modes cold-on \
    --timeout $(( ${T_BEFORE:-50} - 5 )) --tokens ${TOKENS:-16} --work "$WORK" --artifact "$ARTIFACT" \
    --out "$OUT/coldstart/before") 2>&1 | tee "$OUT/coldstart/before/log.txt" | tail -12
fi
find "$OUT/coldstart" -maxdepth 1 -type f | sort
