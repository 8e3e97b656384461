#!/usr/bin/env bash
# The second device call (issue 3): the quality report of the three models that
# tools/h200_train.sh trained, on the GPU (reference backend, float64), written to $OUT.
# Uses runs/h200 when the machine is still the one that trained; otherwise unpacks the
# returned archives carried in .h200/ (data.tgz, sft.tgz, d4.tgz, d8.tgz).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
R=${R:-runs/h200}
OUT=${OUT:-runs/h200_out}
CARRIED=${CARRIED:-.h200}
PROMPTS=${PROMPTS:-48}
NEW=${NEW:-128}
DEVICE=${DEVICE:-cuda}
JOBS=${JOBS:-9}
mkdir -p "$OUT"
if [ ! -f "$R/d8/compact/config.json" ] || [ ! -f "$R/data/corpus.json" ]; then
  echo "runs from the training call are gone; unpacking $CARRIED"
  R=runs/h200_carried
  mkdir -p "$R/data"
  tar xzf "$CARRIED/data.tgz" -C "$R/data" || exit 1
  for r in sft d4 d8; do mkdir -p "$R/$r" && tar xzf "$CARRIED/$r.tgz" -C "$R/$r" || exit 1; done
fi
python -m tools.eval_quality --data "$R/data" --model sft="$R/sft/compact" --model d4="$R/d4/compact" \
  --model d8="$R/d8/compact" --device "$DEVICE" --jobs "$JOBS" --prompts "$PROMPTS" --max-new-tokens "$NEW" \
  --json "$OUT/quality.json" --md "$OUT/quality.md" 2>&1 | tee "$OUT/eval.log"
