#!/bin/bash
# Session 22, call 4: the four kernels-vs-twins token tests with their kernels compiled on the GPU.
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 70 python -m pytest -q -p no:cacheprovider -n 4 tests/test_graph_backend.py::test_triton_kernels_choose_the_twins_tokens \
  tests/test_fused_graph.py::test_fused_on_the_triton_kernels_chooses_the_twins_tokens \
  tests/test_padded_k.py::test_triton_kernels_choose_the_twins_tokens_with_a_padded_ffn \
  tests/test_confidence_calibration.py::test_the_triton_kernels_path_maps_like_the_twins > $OUT/twins_call4.txt 2>&1
echo "twins: $?"; tail -3 $OUT/twins_call4.txt | cut -c1-250
