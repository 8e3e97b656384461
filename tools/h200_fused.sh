#!/usr/bin/env bash
# One device call for issue 16 (fused verify + draft): the row-invariance and fused GPU tests
# (compiled), the kernels per step (tools/profile_fused.py), then bench_e2e's trained part (AR / speculative / hybrid / fused c = 1, 2, 3 on
# the embedded model's held-out prompts, Full runtime; ampere, then fused c = 3 on server)
# and its 2B part (Full: cold start, AR, forced acceptance, the replay cost of every fused
# width, the projection). Each part has its own time limit; results land in $OUT.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 BITMTP_COMMIT=${BITMTP_COMMIT:-unknown}
OUT=${OUT:-runs/h200_fused}
mkdir -p "$OUT/e" "$OUT/s" "$OUT/p"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout ${T_TESTS:-45} python -m pytest -q tests/test_row_invariance.py tests/test_fused_kernels.py \
  tests/test_fused_attention.py 2>&1 | tee "$OUT/pytest_rows.txt" | grep -E "Error|differ|passed|failed|xfail" | head -30
timeout ${T_GPU_TESTS:-50} python -m pytest -q -m gpu tests/test_fused_graph.py tests/test_graph_backend.py \
  2>&1 | tee "$OUT/pytest_gpu.txt" | tail -8
timeout ${T_PROFILE:-30} python tools/profile_fused.py --out "$OUT/p" 2>&1 | tail -8
timeout ${T_E2E:-140} python tools/bench_e2e.py --parts trained,2b --configs full --trained-configs full \
  --artifact bitmtp_edge/embedded/model --prompts ${PROMPTS:-11} --tokens 128 --repeats 2 --candidates 1,2,3 \
  --out "$OUT/e" 2>&1 | tee "$OUT/e2e_log.txt" | tail -60
timeout ${T_SERVER:-30} python tools/bench_e2e.py --backend server --parts trained --trained-configs full \
  --artifact bitmtp_edge/embedded/model --prompts ${PROMPTS:-11} --tokens 128 --repeats 1 --candidates 3 \
  --out "$OUT/s" 2>&1 | tee "$OUT/e2e_server_log.txt" | grep -E "^\| full" | head -12
find "$OUT" -maxdepth 2 -type f | sort
