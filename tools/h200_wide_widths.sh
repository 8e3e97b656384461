#!/usr/bin/env bash
# One device call for the wide W2A8 widths (issue 15: 17-80, the fused-decoding and verify
# widths): the BitNet-2B stack of ternary linears at STACK_WIDTHS under the previous table
# (PREV, a folder holding nvidia_h200.json), the v3 and v5 untuned defaults and the shipped
# table, every launch checked against the twin before timing; the 2B-shape replays under
# the previous and the shipped table; then the GPU tests of the linears. Each part has its
# own limit; logs and JSON land in $OUT.
#   PREV=/tmp/prev OUT=/tmp/ww bash tools/h200_wide_widths.sh
# (As of commit 169530f this script compared variants of v5 through stack scheme suffixes
# and per-scheme tables, `bench_kernels.py --scheme-tables`: tools/results/kernels.md,
# "Wide widths, session 8".)
set -uo pipefail
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_wide_widths}
PREV=${PREV:?a folder with the previous nvidia_h200.json}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/stack_log.txt"
timeout -k 3 "${T_STACK:-60}" python tools/bench_kernels.py --only stack --stack-models bitnet-2b \
  --stack-widths "${STACK_WIDTHS:-1,2,9,16,27,33,40,80}" --legacy-table "$PREV/nvidia_h200.json" \
  --stack-schemes "before (tuned table),v3 untuned,v5 untuned,shipped" --replays 5 --jobs 14 \
  --out "$OUT" >> "$OUT/stack_log.txt" 2>&1
grep -E "stack |precompiled|rror" "$OUT/stack_log.txt" | cut -c1-118
timeout -k 3 "${T_REPLAY:-90}" python tools/bench_replay_widths.py --widths "${WIDTHS:-1,16,32,33,40}" --profile "" \
  --tables "before=$PREV,after=shipped" --jobs 14 --out "$OUT" > "$OUT/replays_log.txt" 2>&1
grep -vE "^\|" "$OUT/replays_log.txt" | grep -E " us|rror|Trace" | tail -n 4 | cut -c1-200
timeout -k 3 "${T_TESTS:-60}" python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/test_kernels_linear.py \
  > "$OUT/gpu_tests.log" 2>&1
tail -n 3 "$OUT/gpu_tests.log" | cut -c1-300
find "$OUT" -maxdepth 2 -type f | sort
