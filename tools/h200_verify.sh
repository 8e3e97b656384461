#!/usr/bin/env bash
# One device call that checks a merged tree on the H200: the 2B-shape decode of the previous
# release and of this tree in one run (BEFORE: a `git archive <commit>` of the previous release
# without its embedded model, checkpoints and results, e.g. into .dev/before), the trained
# embedded model with every policy and fused c = 1..3, then every GPU test. Each part has its
# own limit; the whole call fits in about 6 minutes.
#   BEFORE=.dev/before BEFORE_COMMIT=97ced36 BITMTP_COMMIT=$(git rev-parse --short HEAD) bash tools/h200_verify.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
O=${WORK:-/tmp/h200_verify}
mkdir -p "$O/eb" "$O/ea"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
if [ -n "${BEFORE:-}" ]; then
  (cd "$BEFORE" && BITMTP_COMMIT=${BEFORE_COMMIT:-before} timeout -k 5 ${T_BEFORE:-90} python tools/bench_e2e.py \
     --parts 2b --configs full --tokens 128 --repeats 1 --out "$O/eb" > "$O/eb/log.txt" 2>&1)
  tail -n 25 "$O/eb/log.txt" | cut -c1-220
fi
timeout -k 5 ${T_AFTER:-170} python tools/bench_e2e.py --parts trained,2b --configs full --trained-configs full \
  --artifact bitmtp_edge/embedded/model --prompts 11 --tokens 128 --repeats 1 --candidates 1,2,3 \
  --out "$O/ea" > "$O/ea/log.txt" 2>&1
tail -n 60 "$O/ea/log.txt" | cut -c1-220
# The GPU tests take about 4 min one after another (each engine load compiles and captures);
# with pytest-xdist (not in the device image: carry its wheel and execnet's, see
# docs/measuring.md) five workers share the GPU: 49 tests in about 2 min.
XDIST=$(python -c "import xdist" 2>/dev/null && echo "-n ${GPU_TEST_WORKERS:-5}")
timeout -k 5 ${T_TESTS:-210} python -m pytest -q -m gpu -p no:cacheprovider $XDIST tests > "$O/gpu_tests.log" 2>&1
tail -n 25 "$O/gpu_tests.log" | cut -c1-300
if [ -n "${OUT:-}" ]; then (cd "$O" && tar czf "$OUT/verify.tgz" eb ea gpu_tests.log && ls -la "$OUT"); fi
