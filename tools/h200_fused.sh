#!/usr/bin/env bash
# One device call for issue 16 (fused verify + draft): the GPU tests of the fused states and
# of the graph backend they extend, then bench_e2e's trained part (AR / speculative / hybrid /
# fused on the embedded model's held-out prompts, Full runtime) and its 2B part (Full: AR,
# forced acceptance, the replay cost of every fused width, the projection). Each part has its
# own time limit; results land in $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_fused}
mkdir -p "$OUT/e"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout ${T_TESTS:-110} python -m pytest -q -m gpu tests/test_fused_graph.py tests/test_graph_backend.py \
  2>&1 | tee "$OUT/pytest_gpu.txt" | tail -25
timeout ${T_E2E:-170} python tools/bench_e2e.py --parts trained,2b --configs full --trained-configs full \
  --artifact bitmtp_edge/embedded/model --prompts 8 --tokens 128 --repeats 1 --out "$OUT/e" 2>&1 \
  | tee "$OUT/e2e_log.txt" | tail -70
find "$OUT" -maxdepth 2 -type f | sort
