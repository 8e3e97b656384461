#!/usr/bin/env bash
# session 12, call 2: folded mma without the peeled first step (nopf: no L2 prefetch; after: first two steps prefetched)
set -uo pipefail
export PYTHONUNBUFFERED=1
for v in before nopf; do rm -rf /tmp/$v && cp -a . /tmp/$v && cp -r .dev/$v/* /tmp/$v/; done
TREES="before=/tmp/before nopf=/tmp/nopf" OUT=$OUT BITMTP_COMMIT=${COMMIT:-wip} STACK_WIDTHS=1,9,16,32,33 WIDTHS=1,d16,32,33 T_STACK=60 T_BENCH=100 \
  TESTS="tests/test_kernels_linear.py" T_TESTS=100 bash tools/h200_before_after.sh
rm -f $OUT/stack_*.txt
