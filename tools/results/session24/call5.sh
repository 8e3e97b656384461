#!/bin/bash
# Session 24, call 5: the int8 pass with every row of a call in one tile (up to 64) -- its
# kernel-vs-twin tests compiled (M up to 70), and the head of a fused step's 29 rows (c = 3) on
# 8 SMs and the whole GPU.
export PYTHONPATH=.
O=$OUT/call5; mkdir -p $O
timeout 110 python -m pytest -q -p no:cacheprovider -n 8 tests/test_certified_head.py \
    -k "each_launch or fused_steps or near_ties" > $O/pytest.txt 2>&1
tail -2 $O/pytest.txt
timeout 100 python tools/bench_certified_head.py --sms 0,8 --widths 29 --no-decode --out $O/ch > $O/ch.log 2>&1
tail -14 $O/ch.log
cd $OUT && tar czf results.tgz call5
