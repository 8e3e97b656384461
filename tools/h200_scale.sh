#!/usr/bin/env bash
# Issue 14, the scale round: does a larger backbone pay for its MTP blocks? Nine rounds of
# recipes on the 27M model (tools/results/quality.md) held D = 8's held-out NTP loss 4-5% above
# the SFT baseline; the one lever left untried is capacity. This trains the round-1 pair again —
# the SFT baseline and BitMTP D = 8 from scratch, same corpus, steps, batch, lr and schedule as
# sft-27m / d8 (2,778 steps of 64 x 512 tokens) — at a larger preset, both at once on the one
# GPU, then measures what round 1 measured: held-out NTP loss of both and the D = 8 model's
# decoding replay on the held-out prompts (the release model beside it as the control).
#
# The trainings outlast one device call (10 minutes), so the script is re-entrant: each call
# builds what is missing (corpus), resumes every run that has a resume.pt and is not finished
# (`tools.train --resume`), stops each one TAIL_S before BUDGET with its state saved, and
# evaluates once both have reached STEPS. Between calls the device keeps $R only while the
# machine stays warm: send the next call straight after the last one returns (a machine given
# back loses $R, and a 56M run's resume state, ~680 MB with the optimiser's, cannot travel in
# carry or come back through $OUT). RUNS names one run alone, e.g. when the other finished.
#
#   BUDGET=580 bash tools/h200_scale.sh 2>&1 | tee $OUT/session.log     # on the device, repo root, per call
#   BUDGET=200 PRESET=tiny SEQ=64 BATCH=8 BLOCKS=4 STEPS=40 EVAL_PROMPTS=2 MAX_NEW=8 \
#     CORPUS_ARGS="--root a=/some/tree" bash tools/h200_scale.sh         # CPU dry run
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
T0=$(date +%s)
BUDGET=${BUDGET:-580}
TAIL_S=${TAIL_S:-25}           # kept after the trainings stop (packing, logs)
R=${R:-runs/h200s}
OUT=${OUT:-runs/h200s_out}
PRESET=${PRESET:-base56m}
TAG=${TAG:-56}
SEQ=${SEQ:-512}
BATCH=${BATCH:-64}
BLOCKS=${BLOCKS:-40}
STEPS=${STEPS:-2778}           # sft-27m's and d8's (round 1): the same budget at the new size
LR=${LR:-3e-3}                 # round 1's peak (both runs of a pair take the same)
EVAL_PROMPTS=${EVAL_PROMPTS:-40}
MAX_NEW=${MAX_NEW:-128}
NTP_WINDOWS=${NTP_WINDOWS:-128}
REPLAY_JOBS=${REPLAY_JOBS:-8}
SAVE_S=${SAVE_S:-90}
CORPUS_ARGS=${CORPUS_ARGS:-}
RELEASE_DATA=tools/checkpoints/data   # the release test split and held-out prompts
D8=tools/checkpoints/bitmtp-d8-27m
SFT=tools/checkpoints/sft-27m
RUNS=${RUNS:-"sft$TAG d8s$TAG"}  # one of them alone when the other is already trained
mkdir -p "$R/eval" "$OUT"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU") | tee "$R/device.txt"
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
EVAL_DEVICE=$([ "$GPUS" -gt 0 ] && echo cuda || echo cpu)

if [ ! -f "$R/data/corpus.json" ]; then
  # the release tokenizer: the held-out split every model here is scored on is the release one
  python -m tools.corpus build --out "$R/data" --tokenizer "$D8" $CORPUS_ARGS > "$R/corpus.log" 2>&1 || { tail "$R/corpus.log"; exit 1; }
  python -m tools.corpus compare "$R/data" | tee -a "$R/corpus.log"
  echo "corpus built after $(( $(date +%s) - T0 ))s"
fi

# steps_done RUN: the step a run has saved (0 when it has not started)
steps_done() {
  python - "$R/$1" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
log = run / "train_log.json"
print(json.loads(log.read_text()).get("summary", {}).get("steps", 0) if log.is_file() else 0)
EOF
}
train() {  # train RUN ARGS...: start or resume RUN, stopping TAIL_S before the budget
  local run=$1; shift
  local resume=""; [ -f "$R/$run/resume.pt" ] && resume="--resume"
  python -m tools.train --data "$R/data" --out "$R/$run" --preset "$PRESET" --seq-len "$SEQ" \
    --batch-size "$BATCH" --max-steps "$STEPS" --time-budget-s $(( $(left) - TAIL_S )) \
    --lr "$LR" --save-every-s "$SAVE_S" $resume "$@" >> "$R/$run.log" 2>&1
}
PIDS=""
for run in $RUNS; do
  if [ "$(steps_done "$run")" -ge "$STEPS" ]; then echo "$run: done ($STEPS steps)"; continue; fi
  case $run in
    sft*) train "$run" --mtp-weight 0 & ;;
    d8s*) train "$run" --block-size 8 --blocks "$BLOCKS" & ;;
  esac
  PIDS="$PIDS $!"
done
[ -n "$PIDS" ] && wait $PIDS
echo "trainings stopped after $(( $(date +%s) - T0 ))s"
for run in $RUNS; do echo "== $run: $(steps_done "$run") of $STEPS steps"; grep -v "it/s\]" "$R/$run.log" | tail -n 2; done

ALL_DONE=1
for run in $RUNS; do [ "$(steps_done "$run")" -ge "$STEPS" ] || ALL_DONE=0; done
if [ "$ALL_DONE" = 1 ] && [ ! -f "$R/eval/ntp.json" ]; then
  H="--model sft=$SFT --model d8=$D8"; for r in $RUNS; do H="$H --model $r=$R/$r/compact"; done
  timeout $(( $(left) - 10 )) python -m tools.eval_quality --data "$RELEASE_DATA" $H --sections heldout \
    --device "$EVAL_DEVICE" --max-windows "$NTP_WINDOWS" --train-logs none --json "$R/eval/ntp.json" \
    --md "$R/eval/ntp.md" > "$R/eval/ntp.log" 2>&1
  grep -E "^\| [a-z0-9]+ \| [0-9.]+ \|" "$R/eval/ntp.md"
fi
if [ "$ALL_DONE" = 1 ] && [ ! -f "$R/eval/replay_heldout.json" ] && [ "$(left)" -gt 40 ]; then
  timeout $(( $(left) - 10 )) python -m tools.eval_acceptance --data "$RELEASE_DATA" --model "d8=$D8" \
    --model "d8s$TAG=$R/d8s$TAG/compact" --prompts "$EVAL_PROMPTS" --max-new-tokens "$MAX_NEW" \
    --device "$EVAL_DEVICE" --jobs "$REPLAY_JOBS" --json "$R/eval/replay_heldout.json" > "$R/eval/replay_heldout.log" 2>&1
  tail -n 8 "$R/eval/replay_heldout.log"
fi

# What comes back (at most 8 files, 16 MiB each): the finished checkpoints (in parts when
# larger), the training logs and the evaluation.
for run in $RUNS; do
  if [ "$(steps_done "$run")" -ge "$STEPS" ] && [ ! -f "$OUT/$run.tgz" ] && [ -z "$(ls "$OUT/$run".tgz.part-* 2>/dev/null)" ]; then
    tar czf "$OUT/$run.tgz" -C "$R/$run" compact
    if [ "$(stat -c %s "$OUT/$run.tgz")" -gt 15728640 ]; then split -b 15M "$OUT/$run.tgz" "$OUT/$run.tgz.part-" && rm "$OUT/$run.tgz"; fi
  fi
done
tar czf "$OUT/logs.tgz" -C "$R" device.txt eval $(cd "$R" && ls corpus.log *.log 2>/dev/null | sort -u) \
  $(for r in $RUNS; do [ -f "$R/$r/train_log.json" ] && echo "$r/train_log.json"; done)
ls -la "$OUT"
echo "all done after $(( $(date +%s) - T0 ))s"
