#!/usr/bin/env bash
# device call 6: replay candidates at width 16 (the M = 16 entries: the draft width 2D and fused c = 1)
set -uo pipefail
export PYTHONUNBUFFERED=1
C=${C:-unknown}
T="shipped=shipped"; for d in .dev/tables/*; do T="$T,$(basename $d)=$d"; done
(BITMTP_COMMIT=$C PYTHONPATH=. timeout -k 3 200 python tools/bench_replay_widths.py --tables "$T" --profile "" --widths 1,16 \
  --jobs 14 --work /tmp/rw --out $OUT/replays) > $OUT/replays.txt 2>&1
echo "replays: exit $?"; grep -E " us|rror" $OUT/replays.txt | cut -c1-200
