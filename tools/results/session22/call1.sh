#!/bin/bash
# Session 22, call 1: where a width-16 fused replay's time goes beside AR (captured without PDL,
# so kernel durations add up), then split_k / block_n of each projection with the shipped
# long K steps as the base, timed on the stack and in the replays.
set -x
export PYTHONPATH=.
timeout 80 python -m pytest -q -x tests/test_kernels_linear.py -k "long_folded or chains" -p no:cacheprovider 2>&1 | tail -3 > $OUT/pytest_call1.txt
timeout 170 python tools/bench_replay_widths.py --tables shipped=shipped,shipped-nopdl=shipped \
  --profile-tables shipped-nopdl --profile 1,d9,16 --widths 1,d9,v9,16 --jobs 15 --out $OUT/profile 2>&1 | tail -5
timeout 200 python tools/sm_partition_stack.py --sms 0 --widths 9,16 --vary "split_k=1,2,3,4,6;block_n=32,64,128" \
  --vary-each --write-table $OUT/tsk --jobs 15 --passes 5 --out $OUT/stack_split_call1.json 2>&1 | tail -25
ls $OUT/tsk && timeout 140 python tools/bench_replay_widths.py --tables sk=$OUT/tsk,base=shipped,sk2=$OUT/tsk,base2=shipped \
  --widths 1,d9,16 --profile "" --jobs 15 --out $OUT/replays 2>&1 | tail -12
