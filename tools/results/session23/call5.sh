#!/bin/bash
# Session 23, call 5: `bitmtp tune` end to end on the GPU (the user's route to a table, with the
# tuner's layer-wide candidates and the v10 defaults it races), timed; then the 2B-shape decode
# replays with its table against the shipped (hand-assembled) table and the untuned defaults.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
W=/tmp/bitmtp_replay_widths; ART=$W/bitnet2b-artifact
mkdir -p $OUT/tuned
t0=$SECONDS
timeout 330 python -m bitmtp_edge.app.cli tune --models bitnet-2b --widths 1,9,16,24 --jobs 15 \
  --out $OUT/tuned/nvidia_h200.json > $OUT/tune.log 2>&1
echo "tune exit $? after $((SECONDS - t0)) s"; tail -4 $OUT/tune.log | cut -c1-200
left=$((575 - SECONDS))
if [ -f $OUT/tuned/nvidia_h200.json ] && [ $left -gt 70 ]; then
  art=(); [ -f "$ART/manifest.json" ] && art=(--artifact "$ART")
  timeout $((left - 10)) python tools/bench_replay_widths.py --tables "tuned=$OUT/tuned,shipped=shipped,untuned=none" \
    --widths 1,d9,16,24 --profile "" --jobs 15 --work $W "${art[@]}" --out $OUT/replays > $OUT/replays.log 2>&1
  echo "replays: $?"; grep -E "^\| [a-z]" $OUT/replays/replay_widths.md
fi
cd $OUT && tar czf results.tgz --exclude=results.tgz . && find . -mindepth 1 -maxdepth 1 ! -name results.tgz -exec rm -rf {} + ; ls $OUT
