#!/usr/bin/env bash
# One device call for issue 15 (W2A8 at a Jetson's bandwidth): the whole-stack benchmark with
# the sweep that writes this GPU's table (before / untuned / tuned, the Orin projection), then
# the GPU kernel tests. Each part has its own limit; results land in $OUT/k (<= 8 files):
# kernels.json, kernels.md, <gpu>.json (the tuned table: copy it to kernels_ampere/tuned/),
# bench.log, pytest.log, smi.txt.
#   T_STACK=120 T_TESTS=55 STACK_MODELS=bitnet-2b,bitmtp-27m bash tools/h200_kernels.sh
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_kernels}
mkdir -p "$OUT/k"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.sm --format=csv | tee "$OUT/k/smi.txt"
timeout -k 5 ${T_STACK:-120} python tools/bench_kernels.py --only stack,quant --widths 1,16 \
  --stack-models "${STACK_MODELS:-bitnet-2b}" --sweep --replays 5 --jobs 14 --out "$OUT/k" > "$OUT/k/bench.log" 2>&1
grep -E "stack |precompiled|FAIL|rror|rmsnorm|relu2" "$OUT/k/bench.log" | cut -c1-200 | tail -70
timeout -k 3 ${T_TESTS:-55} python -m pytest -q -x -m gpu -p no:cacheprovider tests/test_kernels_linear.py \
  > "$OUT/k/pytest.log" 2>&1
tail -12 "$OUT/k/pytest.log" | cut -c1-400
find "$OUT" -maxdepth 2 -type f | sort
