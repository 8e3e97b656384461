#!/usr/bin/env bash
# device call 6: replay candidates at widths 24, 25, 40, 41 (c = 2 and 4)
set -uo pipefail
export PYTHONUNBUFFERED=1
C=${C:-unknown}
T="prev=.dev/tables/prev,new=.dev/tables/new"
(BITMTP_COMMIT=$C PYTHONPATH=. timeout -k 3 200 python tools/bench_replay_widths.py --tables "$T" --profile "" --widths 1,25,40,48,49,56,64 \
  --jobs 14 --work /tmp/rw --out $OUT/replays) > $OUT/replays.txt 2>&1
echo "replays: exit $?"; grep -E " us|rror" $OUT/replays.txt | cut -c1-200
