#!/usr/bin/env bash
# session 12, call 3: widths 32/33 in folded 16-row tiles (64 x 64, 4 warps), K slices of M = 16 or of the shipped 32/33
set -uo pipefail
export PYTHONUNBUFFERED=1
for v in before bm16s16 bm16sw; do rm -rf /tmp/$v && cp -a . /tmp/$v && cp -r .dev/$v/* /tmp/$v/; done
TREES="before=/tmp/before bm16s16=/tmp/bm16s16 bm16sw=/tmp/bm16sw" OUT=$OUT BITMTP_COMMIT=${COMMIT:-wip} STACK_WIDTHS=32,33 WIDTHS=1,32,33 T_STACK=60 T_BENCH=100 \
  TESTS="tests/test_kernels_linear.py::test_w2a8_v5_default_folds_every_tensor_core_launch" T_TESTS=60 bash tools/h200_before_after.sh
rm -f $OUT/stack_*.txt
