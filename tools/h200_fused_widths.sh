#!/usr/bin/env bash
# One device call: the shipped W2A8 table against the previous one (PREV, a folder holding
# nvidia_h200.json) in one run: the BitNet-2B stack of ternary linears at STACK_WIDTHS (both
# tables' launches, checked against the twin on the GPU before timing), then the 2B-shape
# replays of WIDTHS (AR = 1, fused widths) under both tables. Logs and JSON land in $OUT.
#   PREV=/tmp/prev OUT=/tmp/fw bash tools/h200_fused_widths.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_fused_widths}
PREV=${PREV:?a folder with the previous nvidia_h200.json}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/smi.txt"
timeout -k 3 "${T_STACK:-60}" python tools/bench_kernels.py --only stack --stack-models bitnet-2b \
  --stack-widths "${STACK_WIDTHS:-33,40}" --legacy-table "$PREV/nvidia_h200.json" \
  --stack-schemes "before (tuned table),shipped" --replays 5 --jobs 14 --out "$OUT" > "$OUT/stack_log.txt" 2>&1
grep -E "stack |precompiled|rror" "$OUT/stack_log.txt" | cut -c1-110
timeout -k 3 "${T_REPLAY:-120}" python tools/bench_replay_widths.py --tables "before=$PREV,after=shipped" \
  --widths "${WIDTHS:-1,16,32,33,40}" --profile "" --jobs 14 --out "$OUT" > "$OUT/replays_log.txt" 2>&1
grep -vE "^\|" "$OUT/replays_log.txt" | grep -E " us|rror|Trace" | tail -n 6 | cut -c1-220
sed -n '/^| table/,/^$/p' "$OUT/replay_widths.md"
find "$OUT" -maxdepth 2 -type f | sort
