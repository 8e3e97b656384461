#!/usr/bin/env bash
# One device call for wide steps at the cost of narrow ones (issues 15, 16) and group-128 row
# invariance: the W2A8 row-invariance test (compiled), the BitNet-2B stack of the previous
# commit (BEFORE: a `git archive` of it, e.g. into .dev/before) and of this tree in one run,
# this tree's sweep of the widths in SWEEP_WIDTHS (writes this GPU's table; the previous
# table's launches, v3 and v4 untuned compete per width on the whole stack), then the GPU
# kernel tests. Each part has its own limit; logs and JSON land in $OUT.
#   BEFORE=.dev/before BEFORE_COMMIT=923e33a OUT=/tmp/wide bash tools/h200_wide_steps.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_wide_steps}
mkdir -p "$OUT/before" "$OUT/after"
W=${STACK_WIDTHS:-1,2,9,16,27,33,40,80}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/smi.txt"
timeout -k 3 "${T_INV:-35}" python -m pytest -q -p no:cacheprovider tests/test_row_invariance.py -k w2a8_rows \
  > "$OUT/pytest_row_invariance.log" 2>&1
tail -n 4 "$OUT/pytest_row_invariance.log" | cut -c1-300
if [ -n "${BEFORE:-}" ]; then
  (cd "$BEFORE" && BITMTP_COMMIT=${BEFORE_COMMIT:-before} timeout -k 3 "${T_BEFORE:-40}" python tools/bench_kernels.py \
     --only stack --stack-models bitnet-2b --stack-widths "$W" --stack-schemes shipped --replays 5 --jobs 14 \
     --out "$OUT/before" > "$OUT/before/bench.log" 2>&1)
  grep -E "stack |precompiled|rror" "$OUT/before/bench.log" | cut -c1-120
fi
cp kernels_ampere/tuned/nvidia_h200.json "$OUT/previous_table.json"  # "before (tuned table)": its launches, this tree's kernels
timeout -k 3 "${T_AFTER:-80}" python tools/bench_kernels.py --only stack --stack-models bitnet-2b --stack-widths "$W" \
  --sweep --sweep-widths "${SWEEP_WIDTHS:-9,16,27,33,40,80}" --legacy-table "$OUT/previous_table.json" \
  --stack-schemes "before (tuned table),v3 untuned,v4 untuned" --replays 5 --jobs 14 --out "$OUT/after" \
  > "$OUT/after/bench.log" 2>&1
grep -E "stack |table M|precompiled|rror|wrote" "$OUT/after/bench.log" | cut -c1-120
timeout -k 3 "${T_TESTS:-50}" python -m pytest -v -m gpu -p no:cacheprovider tests/test_kernels_linear.py \
  > "$OUT/pytest_kernels_linear.log" 2>&1
grep -cE "PASSED" "$OUT/pytest_kernels_linear.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/pytest_kernels_linear.log" | tail -n 8 | cut -c1-300
find "$OUT" -maxdepth 2 -type f | sort
