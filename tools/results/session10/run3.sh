#!/usr/bin/env bash
# device call 3: e2e trained before/after in one call; replay candidates at widths 32/33
set -uo pipefail
export PYTHONUNBUFFERED=1
C=${C:-unknown}
cp -a . /tmp/before && cp .dev/before/w2a8.py .dev/before/common.py /tmp/before/kernels_ampere/
for t in before=/tmp/before after=$(pwd) before2=/tmp/before after2=$(pwd); do
  n=${t%%=*}; d=${t#*=}
  (cd $d && BITMTP_COMMIT=$C+$n PYTHONPATH=. timeout -k 3 50 python tools/bench_e2e.py --parts trained --trained-configs full --prompts 11 --tokens 128 --out $OUT/e2e_$n) > $OUT/e2e_$n.txt 2>&1
  echo "e2e $n: exit $?"; grep -E "^\| full \| (ar|speculative|fused)" $OUT/e2e_$n/*.md | cut -c1-120
done
T="shipped=shipped"; for d in .dev/tables/*; do T="$T,$(basename $d)=$d"; done
(BITMTP_COMMIT=$C PYTHONPATH=. timeout -k 3 150 python tools/bench_replay_widths.py --tables "$T" --profile "" --widths 1,32,33 \
  --jobs 14 --work /tmp/rw --out $OUT/replays) > $OUT/replays.txt 2>&1
echo "replays: exit $?"; grep -E " us|rror" $OUT/replays.txt | cut -c1-200
tar czf $OUT/results.tgz -C $OUT replays e2e_before e2e_after e2e_before2 e2e_after2 && rm -rf $OUT/replays $OUT/e2e_*/
ls $OUT
