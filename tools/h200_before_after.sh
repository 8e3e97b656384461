#!/usr/bin/env bash
# One device call: variants of a W2A8 kernel change side by side, on the BitNet-2B shape.
# TREES names copies of the tree (`cp -a . /tmp/before` plus that variant's files) as name=path;
# this tree is "after". Every tree, one after the other, in the same call:
#   bench_kernels.py --only stack   the 120 ternary linears in one CUDA graph at STACK_WIDTHS
#                                   (shipped table; every launch checked against the twin first)
#   bench_replay_widths.py          the 2B-shape replays at WIDTHS (1 = AR, the others fused)
# then this tree's GPU tests (TESTS, -m gpu). Each part has its own time limit, so a slow one
# cuts itself, not the rest. Logs in $OUT; each tree's JSON and Markdown packed into
# $OUT/trees.tgz (a device call returns at most 8 files).
#   TREES="before=/tmp/before" OUT=/tmp/ba BITMTP_COMMIT=abc bash tools/h200_before_after.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-runs/h200_before_after}
TREES=${TREES:?name=path of each copy of the tree to compare with}
STACK_WIDTHS=${STACK_WIDTHS:-1,9,16,27,33,40,80}
WIDTHS=${WIDTHS:-1,16,32,33}
WORK=${WORK:-/tmp/bitmtp_replay_widths}
ART=$WORK/bitnet2b-artifact
TESTS=${TESTS:-tests/test_kernels_linear.py}
TREES="$TREES after=$(pwd)"
COMMIT=${BITMTP_COMMIT:-unknown}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader

stack() {  # tree, name, commit
  mkdir -p "$OUT/$2"
  (cd "$1" && BITMTP_COMMIT=$3 PYTHONPATH=. timeout -k 3 "${T_STACK:-50}" python tools/bench_kernels.py --only stack \
    --stack-models bitnet-2b --stack-widths "$STACK_WIDTHS" --stack-schemes shipped --replays 5 --jobs 14 \
    --out "$OUT/$2") > "$OUT/stack_$2.txt" 2>&1
  echo "stack $2: exit $?"; grep -E "stack bitnet-2b|rror" "$OUT/stack_$2.txt" | cut -c1-110
}

replays() {  # tree, name, commit: the first call builds the artifact, the second reuses it
  local art=()
  [ -f "$ART/manifest.json" ] && art=(--artifact "$ART")
  (cd "$1" && BITMTP_COMMIT=$3 PYTHONPATH=. timeout -k 3 "${T_BENCH:-80}" python tools/bench_replay_widths.py \
    --tables shipped=shipped --profile "" --widths "$WIDTHS" --jobs 14 --work "$WORK" "${art[@]}" \
    --out "$OUT/$2") > "$OUT/replays_$2.txt" 2>&1
  echo "replays $2: exit $?"; grep -E " us|rror" "$OUT/replays_$2.txt" | tail -n 3 | cut -c1-200
}

for t in $TREES; do stack "${t#*=}" "${t%%=*}" "$COMMIT+${t%%=*}"; done
for t in $TREES; do replays "${t#*=}" "${t%%=*}" "$COMMIT+${t%%=*}"; done
# shellcheck disable=SC2086
timeout -k 3 "${T_TESTS:-60}" python -m pytest -q -m gpu -n 6 -p no:cacheprovider $TESTS > "$OUT/gpu_tests.log" 2>&1
echo "gpu tests: exit $?"; tail -n 2 "$OUT/gpu_tests.log" | cut -c1-300
names=""; for t in $TREES; do names="$names ${t%%=*}"; done
# shellcheck disable=SC2086
tar czf "$OUT/trees.tgz" -C "$OUT" $names && (cd "$OUT" && rm -rf $names)
find "$OUT" -maxdepth 2 -type f | sort
