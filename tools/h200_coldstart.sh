#!/usr/bin/env bash
# One device call for issue 16 item 3 (cold start), at most WALL (150) seconds: the BitNet-2B
# shape's startup (tools/bench_startup.py: a fresh process and Triton cache folder per load,
# each load time-limited, the run within its budget), in the modes that decide the open
# questions, the most decisive first:
#   cold-on      cold, the pass with compile threads (the default mode): the 10 s target
#   warm-on      warm (cold-on's cache): the warm marker skips the pass, one warm-up run per state
#   warm-off-on  warm (the same cache), the pass off: two warm-up runs, no marker (the baseline
#                "precompile default on" is judged against)
#   cold-proc    cold, the pass with worker processes
# Every mode that decodes must give the same tokens (AR and fused). Results: $OUT/coldstart
# (startup.json, startup.md, logs; before/ for the BEFORE checkout).
#   ARTIFACT=DIR   use this artifact instead of building the 2B shape (a CPU dry run: any test
#                  artifact); by default an artifact a previous call left in $WORK is reused
#   BEFORE=DIR     also time BEFORE_MODES (cold-on,warm-on) with the checkout in DIR on the same
#                  artifact, after this tree's modes; BEFORE_COMMIT names it in the report
#   MODES, WALL, BEFORE_S (seconds kept for BEFORE, 40), T_LOAD (seconds per load, 35), TOKENS (16)
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_coldstart}
DIR=$OUT/coldstart
WALL=${WALL:-150}
mkdir -p "$DIR"
left() { echo $(( WALL - SECONDS )); }
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  python -c "import os, triton; from triton.runtime import _async_compile; print('triton', triton.__version__, \
'AsyncCompileMode', hasattr(_async_compile, 'AsyncCompileMode'), 'cpus', os.cpu_count())"
} 2>&1 | tee "$DIR/env.txt"
WORK=${WORK:-/tmp/bitmtp-startup}
if [ -z "${ARTIFACT:-}" ] && [ -f "$WORK/bitnet2b-artifact/manifest.json" ]; then ARTIFACT=$WORK/bitnet2b-artifact; fi
keep=$(( ${BEFORE:+${BEFORE_S:-40}} + 0 + 5 ))  # seconds left for BEFORE and the report merge
budget=$(( $(left) - keep - 4 ))
[ $budget -ge 30 ] || budget=30  # WALL too small for BEFORE as well: this tree's modes first
timeout $(( budget + 4 )) python tools/bench_startup.py --modes "${MODES:-cold-on,warm-on,warm-off-on,cold-proc}" \
  --budget $budget --timeout ${T_LOAD:-35} --tokens ${TOKENS:-16} --work "$WORK" \
  ${ARTIFACT:+--artifact "$ARTIFACT"} --out "$DIR" 2>&1 | tee "$DIR/log.txt" | tail -30
if [ -n "${BEFORE:-}" ]; then
  ARTIFACT=${ARTIFACT:-$WORK/bitnet2b-artifact}
  mkdir -p "$DIR/before"
  budget=$(( $(left) - 9 ))
  if [ $budget -ge 15 ]; then
    (cd "$BEFORE" && BITMTP_COMMIT=${BEFORE_COMMIT:-unknown} PYTHONPATH=. timeout $(( budget + 4 )) python \
      tools/bench_startup.py --modes "${BEFORE_MODES:-cold-on,warm-on}" --budget $budget --timeout ${T_LOAD:-35} \
      --tokens ${TOKENS:-16} --work "$WORK" --artifact "$ARTIFACT" --out "$DIR/before") 2>&1 \
      | tee "$DIR/before/log.txt" | tail -8
    python tools/bench_startup.py --out "$DIR" --before "$DIR/before/startup.json" > /dev/null \
      || echo "no before report to merge"
  else
    echo "BEFORE skipped: $(left) s left of WALL=$WALL" | tee "$DIR/before/log.txt"
  fi
fi
cat "$DIR/startup.md" 2>/dev/null | sed -n '/^| start/,/^$/p'
echo "h200_coldstart: $SECONDS s"
find "$DIR" -maxdepth 2 -type f | sort
