#!/bin/bash
# Session 23, call 2: (a) the H200 table's wide entries against the v10 defaults in the 2B-shape
# replays at the fused widths 33-64; (b) the board proxy (8 SMs in a green context, mma.sync, no
# programmatic launch) of this tree against the files of session 22's start (before_tree/:
# 1875b77's bitmtp_edge/ and kernels_ampere/ over a copy of this tree): what session 22's cut
# torch launches save on an Orin's SM count.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
W=/tmp/bitmtp_replay_widths; ART=$W/bitnet2b-artifact
cp -a . /tmp/before && cp -r before_tree/. /tmp/before/ && rm -rf /tmp/before/before_tree before_tree
rep() {  # tree name seconds args...: skipped when less than a minute of the call's 575 s is left
  local tree=$1 name=$2 cap=$3; shift 3; local left=$((575 - SECONDS))
  [ $left -lt 60 ] && { echo "$name skipped ($left s)"; return; }
  local art=(); [ -f "$ART/manifest.json" ] && art=(--artifact "$ART")
  (cd $tree && timeout $((left < cap + 10 ? left - 10 : cap)) python tools/bench_replay_widths.py --profile "" --jobs 15 \
    --work $W "${art[@]}" --out $OUT/$name "$@") > $OUT/$name.log 2>&1
  echo "$name: $?"; grep -E "^\| [a-z]" $OUT/$name/replay_widths.md | head -4
}
rep . wide_h200 150 --tables "shipped=shipped,untuned=none" --widths 1,33,40,48,64
DISABLE_MMA_V3=1 BITMTP_PDL=0 rep . proxy8_after 170 --sms 8 --tables board=none --widths 1,d9,16
DISABLE_MMA_V3=1 BITMTP_PDL=0 rep /tmp/before proxy8_before 170 --sms 8 --tables board=none --widths 1,d9,16
cd $OUT && tar czf results.tgz --exclude=results.tgz . && find . -mindepth 1 -maxdepth 1 ! -name results.tgz -exec rm -rf {} + ; ls $OUT
