#!/usr/bin/env bash
# One device call for the cost of wide steps (issues 15, 16): the new W2A8 launches compiled
# and checked on the GPU (graph replays of the in-kernel split-K reduction), the BitNet-2B
# stack before / after in one run (the shipped table as "before", its launches with the
# in-kernel reduction, the v3 and v5 defaults, a per-shape sweep at SWEEP_WIDTHS; the table
# of TABLE_WIDTHS and SWEEP_WIDTHS takes each width's stack-fastest scheme), then the
# 2B-shape replays of WIDTHS under the previous table and the new one, with a per-kernel
# profile of PROFILE widths. Each part has its own limit; logs and JSON land in $OUT.
#   OUT=/tmp/fw bash tools/h200_fused_widths.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_fused_widths}
mkdir -p "$OUT/stack" "$OUT/replays" "$OUT/before_table"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/smi.txt"
cp kernels_ampere/tuned/nvidia_h200.json "$OUT/before_table/nvidia_h200.json"
timeout -k 3 "${T_TESTS:-30}" python -m pytest -q -p no:cacheprovider tests/test_kernels_linear.py \
  -k "inline_split or split_counters" > "$OUT/pytest_inline.log" 2>&1
tail -n 2 "$OUT/pytest_inline.log" | cut -c1-300
timeout -k 3 "${T_STACK:-150}" python tools/bench_kernels.py --only stack --stack-models bitnet-2b \
  --stack-widths "${STACK_WIDTHS:-1,9,16,32,33,40}" --sweep --sweep-widths "${SWEEP_WIDTHS:-32,33}" \
  --table-widths "${TABLE_WIDTHS:-9,16,40}" --legacy-table "$OUT/before_table/nvidia_h200.json" \
  --stack-schemes "before (tuned table),before (tuned table)+ir,v3 untuned,v5 untuned" --replays 5 --jobs 14 \
  --out "$OUT/stack" > "$OUT/stack/bench.log" 2>&1
grep -E "stack |table M|precompiled|rror|wrote" "$OUT/stack/bench.log" | cut -c1-110
timeout -k 3 "${T_REPLAY:-120}" python tools/bench_replay_widths.py \
  --tables "before=$OUT/before_table,after=shipped" --widths "${WIDTHS:-1,16,32,33,40}" \
  --profile "${PROFILE:-32,33}" --jobs 14 --out "$OUT/replays" > "$OUT/replays/log.txt" 2>&1
grep -vE "^\|" "$OUT/replays/log.txt" | tail -n 8 | cut -c1-200
head -n 12 "$OUT/replays/replay_widths.md" 2>/dev/null | tail -n 4
find "$OUT" -maxdepth 2 -type f | sort
