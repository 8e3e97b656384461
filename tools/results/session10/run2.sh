#!/usr/bin/env bash
# device call 2: gated split-K stack, replay-width candidates at 32/33, e2e, GPU tests
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
C=${C:-unknown}
(BITMTP_COMMIT=$C timeout -k 3 45 python tools/bench_kernels.py --only stack --stack-models bitnet-2b --stack-widths 1,9,16,33,80 \
  --stack-schemes shipped --replays 5 --jobs 14 --out $OUT/stack) > $OUT/stack.txt 2>&1
echo "stack: exit $?"; grep -E "stack bitnet-2b|rror" $OUT/stack.txt | cut -c1-110
T="shipped=shipped"; for d in .dev/tables/*; do T="$T,$(basename $d)=$d"; done
(BITMTP_COMMIT=$C timeout -k 3 200 python tools/bench_replay_widths.py --tables "$T" --profile "" --widths 1,16,32,33 \
  --jobs 14 --work /tmp/rw --out $OUT/replays) > $OUT/replays.txt 2>&1
echo "replays: exit $?"; grep -E " us|rror" $OUT/replays.txt | cut -c1-200
(BITMTP_COMMIT=$C timeout -k 3 60 python tools/bench_e2e.py --parts trained --trained-configs full --prompts 11 --tokens 128 --out $OUT/e2e_trained) > $OUT/e2e_trained.txt 2>&1
echo "e2e trained: exit $?"; grep -E "^\| full" $OUT/e2e_trained/*.md | cut -c1-200
timeout -k 3 90 python -m pytest -q -m gpu -n 6 -p no:cacheprovider tests/test_kernels_linear.py tests/test_row_invariance.py > $OUT/gpu_tests.log 2>&1
echo "gpu tests: exit $?"; tail -n 2 $OUT/gpu_tests.log | cut -c1-300
tar czf $OUT/results.tgz -C $OUT stack replays e2e_trained && rm -rf $OUT/stack $OUT/replays $OUT/e2e_trained
ls $OUT
