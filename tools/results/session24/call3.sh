#!/bin/bash
# Session 24, call 3: the certified head in the fused step -- tests compiled, the head timings
# with a fused step's rows (whole H200, 8 SMs), and `bitmtp bench` on the embedded model with the
# 16-bit head and the certified one (AR, fused, hybrid: tokens, tokens per forward, tok/s).
export PYTHONPATH=.
O=$OUT/call3; mkdir -p $O
timeout 200 python -m pytest -q -p no:cacheprovider -n 8 tests/test_certified_head.py tests/test_fused_graph.py \
    -k "not generation_counts" > $O/pytest.txt 2>&1   # (that test imports fastapi: not on this image)
tail -3 $O/pytest.txt
timeout 150 python tools/bench_certified_head.py --sms 0,8 --widths 1,16 --no-decode --out $O/ch > $O/ch.log 2>&1
tail -14 $O/ch.log
i=0
for head in 16bit certified 16bit certified; do
  i=$((i + 1)); n=_$i
  timeout 80 python -m bitmtp_edge.app.cli bench --backend ampere --device cuda --head $head \
      --policies ar,fused,hybrid --num-prompts 8 --max-new-tokens 128 --repeats 3 --out $O/bench_$head$n \
      > $O/bench_$head$n.log 2>&1
  grep -E "^\| (ar|fused|hybrid)" $O/bench_$head$n/bench.md | head -6
done
cd $OUT && tar czf results.tgz call3 && ls -la results.tgz
