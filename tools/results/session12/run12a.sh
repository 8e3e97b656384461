#!/usr/bin/env bash
# session 12, call 1: gemv activation words loaded in the weight tile's shape (A masked, after = unmasked clamped)
set -uo pipefail
export PYTHONUNBUFFERED=1
for v in before varA; do rm -rf /tmp/$v && cp -a . /tmp/$v && cp -r .dev/$v/* /tmp/$v/; done
TREES="before=/tmp/before masked=/tmp/varA" OUT=$OUT BITMTP_COMMIT=${COMMIT:-wip} STACK_WIDTHS=1,2 WIDTHS=1,d16 T_STACK=40 T_BENCH=90 \
  TESTS="tests/test_kernels_linear.py tests/test_kernels_heads.py tests/test_fused_graph.py tests/test_row_invariance.py tests/test_graph_backend.py" T_TESTS=150 bash tools/h200_before_after.sh
rm -f $OUT/stack_*.txt
