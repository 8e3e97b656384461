#!/bin/bash
# Session 24, call 4: the session's code as final, compiled on the H200 -- the whole -m gpu suite,
# then the certified head's and the fused graph's tests (their CPU-named tests run the kernels
# compiled where CUDA is present).
export PYTHONPATH=.
O=$OUT/call4; mkdir -p $O
timeout 200 python -m pytest -q -p no:cacheprovider -n 8 -m gpu -k "not real_shapes_exact and not generation_counts" \
    > $O/pytest_gpu.txt 2>&1
tail -3 $O/pytest_gpu.txt
timeout 300 python -m pytest -q -p no:cacheprovider -n 8 tests/test_certified_head.py tests/test_fused_graph.py \
    -k "not generation_counts" > $O/pytest_certified_fused.txt 2>&1   # (that test imports fastapi: not on this image)
tail -3 $O/pytest_certified_fused.txt
cd $OUT && tar czf results.tgz call4
