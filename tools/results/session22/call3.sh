#!/bin/bash
# Session 22, call 3: the kernels-vs-twins token tests that failed in call 2 (this tree, the
# paired attention tiles dropped; and the session's start), the GPU tests call 2 did not reach,
# and the replays once more (this tree against the start).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
W=/tmp/bitmtp_replay_widths; ART=$W/bitnet2b-artifact
cp -a . /tmp/before && cp -r before_tree/. /tmp/before/ && rm -rf /tmp/before/before_tree before_tree
TWIN="tests/test_graph_backend.py::test_triton_kernels_choose_the_twins_tokens tests/test_fused_graph.py::test_fused_on_the_triton_kernels_chooses_the_twins_tokens"
timeout 90 python -m pytest -q -p no:cacheprovider $TWIN -n 2 > $OUT/twins_after.txt 2>&1; echo "twins after: $?"; tail -2 $OUT/twins_after.txt
(cd /tmp/before && timeout 90 python -m pytest -q -p no:cacheprovider $TWIN -n 2) > $OUT/twins_before.txt 2>&1; echo "twins before: $?"; tail -2 $OUT/twins_before.txt
timeout 170 python -m pytest -q -p no:cacheprovider -n 4 tests/test_kernels_rope.py tests/test_fused_attention.py \
  tests/test_row_invariance.py tests/test_fused_graph.py tests/test_graph_backend.py tests/test_kernels_linear.py \
  -k "not real_shapes_exact and not twins_tokens and (v9 or kept_inverse or length_affine or gpu or invariance)" \
  > $OUT/pytest_call3.txt 2>&1; echo "gpu tests: $?"; grep -E "passed|failed|FAILED|Error" $OUT/pytest_call3.txt | tail -8
rep() {
  local tree=$1 name=$2; local left=$((570 - SECONDS)); [ $left -lt 60 ] && { echo "$name skipped"; return; }
  local art=(); [ -f "$ART/manifest.json" ] && art=(--artifact "$ART")
  (cd $tree && timeout $((left < 130 ? left - 10 : 120)) python tools/bench_replay_widths.py --tables shipped=shipped \
    --widths 1,d9,16 --profile "" --jobs 15 --work $W "${art[@]}" --out $OUT/$name) > $OUT/$name.log 2>&1
  echo "$name: $?"; grep -E "^\| shipped" $OUT/$name/replay_widths.md
}
rep . after; rep /tmp/before before
cd $OUT && tar czf results.tgz after before *.log && rm -rf after before *.log; ls $OUT
