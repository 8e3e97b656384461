#!/bin/bash
# Session 24, call 2: the certified head with its plane kernel -- tests compiled, the head
# timings (whole H200, 8 SMs), greedy AR on the embedded model, and a per-kernel profile.
export PYTHONPATH=.
O=$OUT/call2; mkdir -p $O
timeout 170 python -m pytest -q -p no:cacheprovider -n 6 tests/test_certified_head.py \
    -k "not generation_counts" > $O/pytest.txt 2>&1   # (that test imports fastapi: not on this image)
tail -3 $O/pytest.txt
timeout 100 python tools/results/session24/profile_certified.py > $O/profile.txt 2>&1; cat $O/profile.txt
timeout 200 python tools/bench_certified_head.py --sms 0,8 --widths 1,9,16 --prompts 8 --tokens 96 \
    --out $O/ch > $O/ch.log 2>&1
tail -32 $O/ch.log
cd $OUT && tar czf results.tgz call2 && ls -la results.tgz
