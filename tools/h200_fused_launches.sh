#!/usr/bin/env bash
# One device call: the fused step's launches before and after a change, on the BitNet-2B shape.
# BEFORE is a copy of the tree to compare with (`cp -a . /tmp/before` before applying the
# change); this tree is "after". Both trees, one after the other, on one artifact:
#   bench_replay_widths.py  the replays of WIDTHS (1 = AR, the others fused) with programmatic
#                           launch, and captured without it, profiled per kernel (durations add up)
# then this tree's GPU tests (TESTS, -m gpu), then both trees' profile_fused.py (kernels and GPU
# µs of the eager AR / draft / verify / fused steps). Each part has its own time limit, so a
# slow one cuts itself, not the rest. JSON under $OUT/{before,after}; logs in $OUT (8 files).
# SITE: a folder to add to PYTHONPATH for the tests (pytest-xdist).
#   BEFORE=/tmp/before OUT=/tmp/fl BEFORE_COMMIT=abc AFTER_COMMIT=def bash tools/h200_fused_launches.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/h200_fused_launches}
BEFORE=${BEFORE:?a copy of the tree to compare with}
WIDTHS=${WIDTHS:-1,16,32,33}
WORK=${WORK:-/tmp/bitmtp_replay_widths}
ART=$WORK/bitnet2b-artifact
TESTS=${TESTS:-tests/test_kernels_quant.py tests/test_kernels_attention.py tests/test_fused_kernels.py tests/test_kernels_heads.py
tests/test_kernels_linear.py::test_w2a8_real_shapes_exact_on_gpu tests/test_fused_graph.py tests/test_row_invariance.py}
AFTER=$(pwd)
mkdir -p "$OUT/before" "$OUT/after"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader

bench() {  # tree, name, commit: the first call builds the artifact, the second reuses it
  local art=()
  [ -f "$ART/manifest.json" ] && art=(--artifact "$ART")
  (cd "$1" && BITMTP_COMMIT=$3 PYTHONPATH=. timeout -k 3 "${T_BENCH:-80}" python tools/bench_replay_widths.py \
    --tables shipped=shipped,shipped-nopdl=shipped --profile-tables shipped-nopdl --profile "$WIDTHS" \
    --widths "$WIDTHS" --jobs 14 --work "$WORK" "${art[@]}" --out "$OUT/$2") > "$OUT/log_$2.txt" 2>&1
  echo "bench $2: exit $?"; grep -E " us \(|rror" "$OUT/log_$2.txt" | tail -n 3 | cut -c1-200
}

profile() {  # tree, name (appends to that tree's log)
  (cd "$1" && PYTHONPATH=. timeout -k 3 "${T_PROFILE:-30}" python tools/profile_fused.py --artifact "$ART" \
    --out "$OUT/$2") >> "$OUT/log_$2.txt" 2>&1
  echo "profile $2: exit $?"; grep -E "^\| (ar|fused)" "$OUT/log_$2.txt" | cut -c1-120
}

bench "$BEFORE" before "${BEFORE_COMMIT:-unknown}"
bench "$AFTER" after "${AFTER_COMMIT:-unknown}"
# shellcheck disable=SC2086  # TESTS is a list
PYTHONPATH=".${SITE:+:$SITE}" timeout -k 3 "${T_TESTS:-70}" python -m pytest -q -n 5 -m gpu $TESTS \
  > "$OUT/tests.txt" 2>&1
echo "gpu tests: exit $?"; grep -vE "Warning|warner|^$|bringing up" "$OUT/tests.txt" | tail -n 4 | cut -c1-200
profile "$BEFORE" before
profile "$AFTER" after
rm -f "$OUT"/*/*.md  # the JSON holds the same, and only 8 files come back
find "$OUT" -maxdepth 2 -type f | sort
