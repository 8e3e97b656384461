#!/usr/bin/env bash
# One device call that checks a merged tree on the H200: every GPU test, the whole-stack W2A8
# benchmark (issue 15), and the 2B-shape decode before/after in one run (BEFORE: a checkout of
# the previous release without its embedded model, e.g. `git archive <commit>` into .dev/before),
# plus the trained embedded model with every policy (fused included). Each part has its own limit.
#   BEFORE=.dev/before BITMTP_COMMIT=$(git rev-parse --short HEAD) bash tools/h200_verify.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_verify}
mkdir -p "$OUT/k" "$OUT/ea" "$OUT/eb"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout -k 5 ${T_TESTS:-180} python -m pytest -q -m gpu -p no:cacheprovider tests > "$OUT/gpu_tests.log" 2>&1
tail -n 15 "$OUT/gpu_tests.log" | cut -c1-300
timeout -k 5 ${T_KERNELS:-110} python tools/bench_kernels.py --only stack,quant --widths 1,16 \
  --stack-models bitnet-2b --replays 5 --jobs 14 --out "$OUT/k" > "$OUT/k/bench.log" 2>&1
grep -E "stack |FAIL|rror" "$OUT/k/bench.log" | cut -c1-200 | tail -30
if [ -n "${BEFORE:-}" ]; then
  (cd "$BEFORE" && timeout -k 5 ${T_BEFORE:-100} python tools/bench_e2e.py --parts 2b --configs full \
     --tokens 128 --repeats 1 --out "$OUT/eb" > "$OUT/eb/log.txt" 2>&1)
  grep -iE "AR |tok/s|rror" "$OUT/eb/log.txt" | tail -8
fi
timeout -k 5 ${T_AFTER:-150} python tools/bench_e2e.py --parts trained,2b --configs full --trained-configs full \
  --artifact bitmtp_edge/embedded/model --prompts 4 --tokens 128 --repeats 1 --out "$OUT/ea" > "$OUT/ea/log.txt" 2>&1
grep -iE "AR |tok/s|rror" "$OUT/ea/log.txt" | tail -12
find "$OUT" -maxdepth 2 -type f | sort
