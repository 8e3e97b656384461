#!/usr/bin/env bash
# session 11, call: one head pass in the fused step (before = 9e164dc) — replays at c = 1..5, GPU tests, trained e2e
set -uo pipefail
export PYTHONUNBUFFERED=1
rm -rf /tmp/before && cp -a . /tmp/before && cp -r .dev/before/* /tmp/before/
TREES="before=/tmp/before" OUT=$OUT BITMTP_COMMIT=${COMMIT:-wip} STACK_WIDTHS=1 WIDTHS=1,16,32,33,40,41,48 T_STACK=40 T_BENCH=80 \
  TESTS="tests/test_kernels_heads.py tests/test_fused_graph.py tests/test_row_invariance.py" T_TESTS=100 bash tools/h200_before_after.sh
mkdir -p /tmp/e2e
for r in 1; do for t in before after; do
  d=$([ $t = before ] && echo /tmp/before || echo .)
  (cd $d && BITMTP_COMMIT=${COMMIT:-wip}+$t PYTHONPATH=. timeout -k 3 60 python tools/bench_e2e.py --parts trained --trained-configs full \
     --prompts 11 --tokens 128 --out /tmp/e2e/${t}$r) > /tmp/e2e/${t}$r.log 2>&1
  echo "e2e $t $r: $?"; grep -E "^. full |rror" /tmp/e2e/${t}$r.log | head -n 8 | cut -c1-200
done; done
tar czf $OUT/e2e.tgz -C /tmp e2e
rm -f $OUT/stack_*.txt
