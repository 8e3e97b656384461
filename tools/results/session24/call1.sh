#!/bin/bash
# Session 24, call 1: the certified head with candidates (one int8 plane, the candidates' 16-bit
# rows) -- its tests compiled, its head timings on the whole H200 and on 8 SMs, greedy AR on the
# embedded model, and the 2B-shape replays with the 16-bit head and the certified one.
export PYTHONPATH=.
O=$OUT/call1; mkdir -p $O
start=$(date +%s)
left() { echo $(( 560 - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv > $O/gpu.txt 2>&1
timeout 170 python -m pytest -q -x -p no:cacheprovider -n 6 tests/test_certified_head.py > $O/pytest.txt 2>&1
tail -4 $O/pytest.txt
timeout 170 python tools/bench_certified_head.py --sms 0,8 --widths 1,9,16 --prompts 8 --tokens 96 \
    --out $O/ch > $O/ch.log 2>&1
tail -25 $O/ch.log
W=/tmp/rw
for head in 16bit certified; do
  [ $(left) -lt 100 ] && { echo "skip replay $head: $(left) s left"; continue; }
  art=(); [ -d $W/bitnet2b-artifact ] && art=(--artifact $W/bitnet2b-artifact)
  timeout $(( $(left) - 10 )) python tools/bench_replay_widths.py --tables shipped=shipped --widths 1,d9,v9,16 \
      --profile "" --jobs 14 --head $head --work $W "${art[@]}" --out $O/replay_$head > $O/replay_$head.log 2>&1
  tail -3 $O/replay_$head.log
done
cd $OUT && tar czf results.tgz call1 && ls -la results.tgz
