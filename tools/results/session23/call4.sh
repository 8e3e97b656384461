#!/bin/bash
# Session 23, call 4: two K steps loaded at once, multiplied in turn into one accumulator
# (BITMTP_W2A8_ONE_CHAIN=1) against interleaved into two (session 21's chains = 2) and one step
# at a time (the shipped table), on the 2B stack at M = 9, 16, 24; then the decode replays with
# the stack's per-width winner as a table.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
W=/tmp/bitmtp_replay_widths; ART=$W/bitnet2b-artifact
BITMTP_W2A8_ONE_CHAIN=1 timeout 90 python -m pytest -q -p no:cacheprovider tests/test_kernels_linear.py -k "two_chains" \
  > $OUT/pytest_call4.txt 2>&1; echo "one-chain twins: $?"; tail -1 $OUT/pytest_call4.txt
BITMTP_W2A8_ONE_CHAIN=1 timeout 150 python tools/sm_partition_stack.py --sms 0 --widths 9,16,24 --vary "chains=1,2" \
  --write-table $OUT/table_one --jobs 15 --passes 5 --out $OUT/stack_one.json > $OUT/stack_one.log 2>&1
echo "stack one-chain: $?"; grep -E "us|µs" $OUT/stack_one.log | tail -12 | cut -c1-160
timeout 120 python tools/sm_partition_stack.py --sms 0 --widths 9,16 --vary "chains=2" --jobs 15 --passes 5 \
  --out $OUT/stack_two.json > $OUT/stack_two.log 2>&1
echo "stack two chains: $?"; grep -E "us|µs" $OUT/stack_two.log | tail -8 | cut -c1-160
left=$((570 - SECONDS))
if [ -f $OUT/table_one/nvidia_h200.json ] && [ $left -gt 80 ]; then
  art=(); [ -f "$ART/manifest.json" ] && art=(--artifact "$ART")
  BITMTP_W2A8_ONE_CHAIN=1 timeout $((left - 10)) python tools/bench_replay_widths.py --tables "one=$OUT/table_one,base=shipped,one2=$OUT/table_one,base2=shipped" \
    --widths 1,d9,16,24 --profile "" --jobs 15 --work $W "${art[@]}" --out $OUT/replays > $OUT/replays.log 2>&1
  echo "replays: $?"; grep -E "^\| [a-z]" $OUT/replays/replay_widths.md
fi
cd $OUT && tar czf results.tgz --exclude=results.tgz . && find . -mindepth 1 -maxdepth 1 ! -name results.tgz -exec rm -rf {} + ; ls $OUT
