#!/bin/bash
# Session 25, calls 1-3 (the same commands on three trees; README.md): the int4 draft head -- its
# tests compiled, the head kernels (int8 / int4 / bf16) at the 2B vocabulary tuned and timed, and
# the 2B-shape replays (AR, draft 9, fused 16) with the int8 and the int4 draft head, on the whole
# H200 and on 8 SMs (the board proxy).  Usage: bash tools/results/session25/call.sh callN
export PYTHONPATH=.
CALL=${1:?give the call's name, e.g. call3}
O=$OUT/$CALL; mkdir -p $O
start=$(date +%s)
left() { echo $(( 570 - ($(date +%s) - start) )); }
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv > $O/gpu.txt 2>&1
timeout 150 python -m pytest -q -p no:cacheprovider -n 6 tests/test_kernels_heads.py tests/test_graph_backend.py \
    -k "int4 or full_vocabulary" > $O/pytest.txt 2>&1
tail -4 $O/pytest.txt
timeout 120 python tools/bench_kernels.py --only heads --widths 1,8,9,16 --tune --tuned-dir $O/tuned \
    --out $O/k > $O/k.log 2>&1
grep -E "head|int4" $O/k.log | tail -24
W=/tmp/rw
run_replay() {  # name, extra args...
  local name=$1; shift
  [ $(left) -lt 70 ] && { echo "skip $name: $(left) s left"; return; }
  art=(); [ -d $W/bitnet2b-artifact ] && art=(--artifact $W/bitnet2b-artifact)
  timeout $(( $(left) - 10 )) python tools/bench_replay_widths.py --tables shipped=shipped --profile "" --jobs 14 \
      --work $W "${art[@]}" --out $O/$name "$@" > $O/$name.log 2>&1
  tail -3 $O/$name.log
}
run_replay replay_int8 --widths 1,d9,16 --draft-head int8
run_replay replay_int4 --widths 1,d9,16 --draft-head int4
export DISABLE_MMA_V3=1 BITMTP_PDL=0  # the board proxy: an Orin's mma.sync, no programmatic launch
run_replay sm8_int8 --sms 8 --tables board=none --widths 1,d9 --repeats 20 --draft-head int8
run_replay sm8_int4 --sms 8 --tables board=none --widths 1,d9 --repeats 20 --draft-head int4
unset DISABLE_MMA_V3 BITMTP_PDL
run_replay replay_int8_b --widths 1,d9,16 --draft-head int8
run_replay replay_int4_b --widths 1,d9,16 --draft-head int4
cd $OUT && tar czf results.tgz $CALL && ls -la results.tgz
