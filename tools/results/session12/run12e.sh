#!/usr/bin/env bash
# session 12, call 9: the probe against the shipped launches compiled for mma.sync (what an Orin runs)
set -uo pipefail
export PYTHONUNBUFFERED=1
DISABLE_MMA_V3=1 BITMTP_COMMIT=${COMMIT:-wip} PYTHONPATH=. timeout -k 3 200 python tools/gluon_w2a8_probe.py --widths 16,32 --variants 128:2:16,128:2:16:1 --replays 10 --out $OUT/probe 2>&1 | grep -v "leaked\|nanobind\|skipped" | tail -20
