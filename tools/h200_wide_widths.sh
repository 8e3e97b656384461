#!/usr/bin/env bash
# One device call for the wide W2A8 widths (issue 15: 17-80, the fused-decoding and verify
# widths) with folded lanes (LinearConfig.fold_lanes, the v5 defaults): the BitNet-2B stack of
# ternary linears at STACK_WIDTHS under the shipped table ("before (tuned table)"), the v3
# default (before) and v5 with three variants (kernel_stack.SCHEME_VARIANTS), every launch checked against the twin
# before timing; a table per scheme (the shipped one with the wide entries replaced), the
# 2B-shape replays under the shipped table and the v5 tables; then the GPU tests of the
# linears. Each part has its own limit; logs and JSON land in $OUT (eight files: the scheme
# tables as tables.tgz).
#   OUT=/tmp/ww bash tools/h200_wide_widths.sh
set -uo pipefail
export PYTHONPATH=".:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_wide_widths}
T=$(mktemp -d)  # the shipped table and the scheme tables
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/stack_log.txt"
cp kernels_ampere/tuned/nvidia_h200.json "$T/shipped_table.json"
timeout -k 3 "${T_STACK:-72}" python tools/bench_kernels.py --only stack --stack-models bitnet-2b \
  --stack-widths "${STACK_WIDTHS:-1,2,9,16,27,33,40,80}" --legacy-table "$T/shipped_table.json" \
  --stack-schemes "before (tuned table),v3 untuned,v5 untuned,v5 untuned+bm32,v5 untuned+bn128,v5 untuned+fold" \
  --scheme-tables "$T/tables" --scheme-table-widths "${TABLE_WIDTHS:-16,27,33,40,80}" --replays 5 --jobs 14 \
  --out "$OUT" >> "$OUT/stack_log.txt" 2>&1
grep -E "stack |precompiled|rror|scheme table" "$OUT/stack_log.txt" | cut -c1-118
tar czf "$OUT/tables.tgz" -C "$T" tables
V="v5=$T/tables/v5_untuned,v5_bm32=$T/tables/v5_untuned_bm32,v5_bn128=$T/tables/v5_untuned_bn128"
timeout -k 3 "${T_REPLAY:-85}" python tools/bench_replay_widths.py --widths "${WIDTHS:-1,16,32,33,40}" --profile "" \
  --tables "before=shipped,$V,v5_fold=$T/tables/v5_untuned_fold" \
  --jobs 14 --out "$OUT" > "$OUT/replays_log.txt" 2>&1
grep -vE "^\|" "$OUT/replays_log.txt" | grep -E " us|rror|Trace" | tail -n 6 | cut -c1-200
timeout -k 3 "${T_TESTS:-40}" python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/test_kernels_linear.py \
  > "$OUT/gpu_tests.log" 2>&1
tail -n 5 "$OUT/gpu_tests.log" | cut -c1-300
find "$OUT" -maxdepth 3 -type f | sort
