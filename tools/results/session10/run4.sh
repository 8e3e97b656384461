#!/usr/bin/env bash
# device call 4: 2B e2e (full runtime) with the previous table and with the new one, one call
set -uo pipefail
export PYTHONUNBUFFERED=1
C=${C:-unknown}
cp -a . /tmp/before && cp .dev/before/nvidia_h200.json /tmp/before/kernels_ampere/tuned/
for t in before=/tmp/before after=$(pwd); do
  n=${t%%=*}; d=${t#*=}
  (cd $d && BITMTP_COMMIT=$C+$n PYTHONPATH=. timeout -k 3 150 python tools/bench_e2e.py --parts 2b --configs full --out $OUT/e2e_2b_$n) > $OUT/e2e_2b_$n.txt 2>&1
  echo "e2e 2b $n: exit $?"; grep -E "^\|" $OUT/e2e_2b_$n/*.md | head -30 | cut -c1-160
done
tar czf $OUT/results.tgz -C $OUT e2e_2b_before e2e_2b_after && rm -rf $OUT/e2e_2b_before $OUT/e2e_2b_after
ls $OUT
