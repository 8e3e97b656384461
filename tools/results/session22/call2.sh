#!/bin/bash
# Session 22, call 2: the decode steps' glue launches (spans / slots in one launch, kept RoPE
# frequencies, gathers by indexing) and the v9 untuned defaults, against the session's start
# (before_tree/: 1875b77's versions of the changed files over a copy of this tree).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
W=/tmp/bitmtp_replay_widths; ART=$W/bitnet2b-artifact
cp -a . /tmp/before && cp -r before_tree/. /tmp/before/ && rm -rf /tmp/before/before_tree before_tree
timeout 110 python -m pytest -q -p no:cacheprovider tests/test_graph_backend.py tests/test_fused_graph.py \
  tests/test_kernels_rope.py tests/test_fused_attention.py tests/test_row_invariance.py tests/test_kernels_linear.py \
  -k "not real_shapes_exact and (v9 or kept_inverse or length_affine or paired or gpu or graph or fused or invariance)" \
  > $OUT/pytest_call2.txt 2>&1; echo "pytest exit $?"; tail -3 $OUT/pytest_call2.txt
timeout 80 python tools/bench_kernels.py --only stack --stack-models bitnet-2b --stack-widths 1,9,16,24 \
  --stack-schemes "shipped,v8 untuned,v9 untuned" --replays 5 --jobs 14 --out $OUT/stack > $OUT/stack.txt 2>&1
echo "stack exit $?"; grep -E "stack bitnet-2b|rror" $OUT/stack.txt | cut -c1-150
rep() {  # tree name tables extra...: skipped when less than a minute of the call's 560 s is left
  local tree=$1 name=$2 tables=$3; shift 3
  local left=$((560 - SECONDS)); [ $left -lt 60 ] && { echo "$name skipped ($left s left)"; return; }
  local art=(); [ -f "$ART/manifest.json" ] && art=(--artifact "$ART")
  (cd $tree && timeout $((left < 130 ? left - 10 : 120)) python tools/bench_replay_widths.py --tables "$tables" --widths 1,d9,16,24 \
    --jobs 15 --work $W "${art[@]}" --out $OUT/$name "$@") > $OUT/$name.txt 2>&1
  echo "$name exit $?"; grep -E "^\| [a-z]" $OUT/$name/replay_widths.md | head -4
}
rep . after "shipped=shipped,untuned=none,shipped-nopdl=shipped" --profile-tables shipped-nopdl --profile 1,d9,16
rep /tmp/before before "shipped=shipped,shipped-nopdl=shipped" --profile-tables shipped-nopdl --profile 1,d9,16
BITMTP_ATTENTION_PAIR=0 rep . after-nopair "shipped=shipped" --profile ""
rep . after2 "shipped=shipped" --profile ""
rep /tmp/before before2 "shipped=shipped" --profile ""
cd $OUT && tar czf results.tgz --exclude=results.tgz --exclude=pytest_call2.txt . && \
  find . -mindepth 1 -maxdepth 1 ! -name results.tgz ! -name pytest_call2.txt -exec rm -rf {} + && ls $OUT
