#!/usr/bin/env bash
# session 12, call 4: explicit-layout (Gluon mma.sync) W2A8 probe vs the shipped launches, 2B stack
set -uo pipefail
export PYTHONUNBUFFERED=1
python -c "import triton; print('triton', triton.__version__)"
BITMTP_COMMIT=${COMMIT:-wip} PYTHONPATH=. timeout -k 3 300 python tools/gluon_w2a8_probe.py --widths 1,16,32 --variants 128:2:16,128:2:16:1,64:2:16:1,256:2:16:1 --out $OUT/probe 2>&1 | grep -v "leaked\|nanobind\|skipped" | tail -40
timeout -k 3 120 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gluon_probe.py 2>&1 | tail -n 3
