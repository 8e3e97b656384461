#!/bin/bash
# Session 23, call 1: the v10 untuned defaults (the whole-width 128-row launch of M = 17..64 sliced
# by its own tiles' count) -- compiled twins tests, the 2B stack (table / v9 / v10) at the widths
# v10 changes, and the decode replays untuned v10 / untuned v9 / table.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
W=/tmp/bitmtp_replay_widths; ART=$W/bitnet2b-artifact
timeout 100 python -m pytest -q -p no:cacheprovider -n 4 tests/test_kernels_linear.py tests/test_kernel_stack.py \
  -k "not real_shapes_exact and (v10 or v9 or generations or untuned_scheme)" > $OUT/pytest_call1.txt 2>&1
echo "gpu tests: $?"; grep -E "passed|failed|FAILED|Error" $OUT/pytest_call1.txt | tail -6
timeout 150 python tools/bench_kernels.py --only stack --stack-models bitnet-2b --stack-widths 1,17,24,32,40,64 \
  --stack-schemes "shipped,v9 untuned,v10 untuned" --replays 5 --jobs 14 --out $OUT/stack > $OUT/stack.txt 2>&1
echo "stack exit $?"; grep -E "^\| bitnet-2b" $OUT/stack/kernels.md | cut -c1-120
rep() {  # name tables, then env: skipped when less than a minute of the call's 570 s is left
  local name=$1 tables=$2; local left=$((570 - SECONDS)); [ $left -lt 60 ] && { echo "$name skipped ($left s)"; return; }
  local art=(); [ -f "$ART/manifest.json" ] && art=(--artifact "$ART")
  timeout $((left < 160 ? left - 10 : 150)) python tools/bench_replay_widths.py --tables "$tables" --widths 1,d9,16,24,32 \
    --profile "" --jobs 15 --work $W "${art[@]}" --out $OUT/$name > $OUT/$name.log 2>&1
  echo "$name: $?"; grep -E "^\| [a-z]" $OUT/$name/replay_widths.md | head -4
}
rep replays_v10 "shipped=shipped,untuned=none"
BITMTP_W2A8_KERNELS=v9 rep replays_v9 "untuned=none"
rep replays_v10b "untuned=none,shipped=shipped"
cd $OUT && tar czf results.tgz --exclude=results.tgz . && find . -mindepth 1 -maxdepth 1 ! -name results.tgz -exec rm -rf {} + ; ls $OUT
