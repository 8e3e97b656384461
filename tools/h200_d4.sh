#!/usr/bin/env bash
# One device call (issue 5): retrain the D = 4 BitMTP model alone with the release plan
# (same data, preset and 2,778 steps as tools/checkpoints/bitmtp-d8-27m; its checkpoint is not
# committed, see tools/checkpoints/README.md), pack and export it, and leave the compact
# checkpoint and the artifact's log in $OUT. Runs the GPU test suite meanwhile when TESTS=1.
#
#   BITMTP_COMMIT=$(git rev-parse --short HEAD) TESTS=1 bash tools/h200_d4.sh   # on the H200
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
T0=$(date +%s)
R=${R:-runs/h200}
OUT=${OUT:-runs/h200_out}
STEPS=${STEPS:-2778}
mkdir -p "$R" "$OUT"
(
  [ -f "$R/data/corpus.json" ] || python -m tools.corpus build --out "$R/data" > "$R/corpus.log" 2>&1 || exit 1
  echo "corpus ready after $(( $(date +%s) - T0 ))s"
  python -m tools.train --data "$R/data" --preset base27m --seq-len 512 --batch-size 64 --max-steps "$STEPS" \
    --time-budget-s "${TRAIN_BUDGET:-420}" --out "$R/d4" --block-size 4 --blocks 80 > "$R/d4.log" 2>&1 || exit 1
  echo "trained after $(( $(date +%s) - T0 ))s"
  python -m tools.pack_checkpoint "$R/d4/final" "$R/bitmtp-d4-27m" || exit 1
  tar czf "$OUT/d4.tgz" -C "$R" bitmtp-d4-27m
  cp "$R/d4/train_log.json" "$OUT/train_d4.json" 2>/dev/null
  python -m export.cli "$R/bitmtp-d4-27m" "$R/art-d4" --max-context 2048 || exit 1
  echo "exported after $(( $(date +%s) - T0 ))s"
) > "$OUT/d4.log" 2>&1 &
TRAIN=$!
if [ "${TESTS:-0}" = 1 ]; then
  timeout "${T_TESTS:-400}" python -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tail -40 | tee "$OUT/gpu_tests.txt"
fi
wait $TRAIN
cat "$OUT/d4.log"; grep -v "it/s\]" "$R/d4.log" | tail -n 8
echo "all done after $(( $(date +%s) - T0 ))s"
