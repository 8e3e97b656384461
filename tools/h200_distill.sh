#!/usr/bin/env bash
# One device call (issue 14), two GPUs of one host: rebuild the corpus with the release
# tokenizer, record the D = 8 model's own greedy continuations (one generator per GPU), then
# three DDP trainings at once (torchrun, 2 processes each, sharing both GPUs):
#   d8sd    bitmtp-d8-27m fine-tuned with self-distillation (distill rows + KL to the clean stream)
#   d8cont  the same steps on corpus rows only (the control: extra steps without distillation)
#   sft2mtp sft-27m -> BitMTP D = 8 with --init, half the from-scratch model's 2,778 steps
# then a quick GPU decode check, and pack checkpoints + logs into $OUT (at most 8 files).
# Every run saves resume state each SAVE_S seconds: a cut-off run continues with --resume.
#
#   bash tools/h200_distill.sh 2>&1 | tee $OUT/session.log   # on the device, from the repo root
#   NPROC=2 BUDGET=300 SEQ=64 BATCH=8 BLOCKS=4 ROWS=16 GEN_BATCH=8 PROMPT=16 SFT_STEPS=6 \
#     CORPUS_ARGS="--root a=/some/tree" DEVICE=cpu bash tools/h200_distill.sh      # CPU dry run
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
T0=$(date +%s)
BUDGET=${BUDGET:-420}          # seconds until everything is packed
R=${R:-runs/h200d}
OUT=${OUT:-runs/h200d_out}
NPROC=${NPROC:-2}
DEVICE=${DEVICE:-auto}
SEQ=${SEQ:-512}
BATCH=${BATCH:-64}
BLOCKS=${BLOCKS:-40}
ROWS=${ROWS:-8192}             # distill rows per generator (one per GPU)
GEN_BATCH=${GEN_BATCH:-1024}
PROMPT=${PROMPT:-128}
SFT_STEPS=${SFT_STEPS:-1389}   # half of the from-scratch D = 8 model's 2,778 steps
LR=${LR:-6e-4}                 # fine-tuning the D = 8 model (it ended its schedule at 3e-4)
LR_SFT=${LR_SFT:-2e-3}         # SFT -> BitMTP: the blocks are new (from scratch: 3e-3)
KL=${KL:-1.0}
SAVE_S=${SAVE_S:-60}
EVAL_PROMPTS=${EVAL_PROMPTS:-10}
CORPUS_ARGS=${CORPUS_ARGS:-}
TRAIN_ARGS=${TRAIN_ARGS:-}
D8=tools/checkpoints/bitmtp-d8-27m
SFT=tools/checkpoints/sft-27m
mkdir -p "$R" "$OUT"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU") | tee "$R/device.txt"
python -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], 'gpus', torch.cuda.device_count())" | tee -a "$R/device.txt"

if [ ! -f "$R/data/corpus.json" ]; then
  python -m tools.corpus build --out "$R/data" --tokenizer "$D8" $CORPUS_ARGS 2>&1 | tee "$R/corpus.log" || exit 1
fi
python - "$R/data/corpus.json" <<'EOF' | tee -a "$R/corpus.log"
import json, sys
built = json.load(open(sys.argv[1]))["corpus_sha256"]
release = json.load(open("tools/checkpoints/data/corpus.json"))["corpus_sha256"]
print("corpus sha256", built[:12], "== release" if built == release else f"!= release {release[:12]} (other file set)")
EOF
echo "corpus ready after $(( $(date +%s) - T0 ))s"

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ ! -f "$R/distill/rows_000.npy" ]; then
  for s in $(seq 0 $(( NPROC - 1 ))); do
    CUDA_VISIBLE_DEVICES=$(( GPUS > 0 ? s % GPUS : 0 )) python -m tools.distill --teacher "$D8" --data "$R/data" \
      --out "$R/distill" --rows "$ROWS" --prompt-len "$PROMPT" --seq-len "$SEQ" --batch "$GEN_BATCH" --shard "$s" \
      --device "$DEVICE" > "$R/distill_$s.log" 2>&1 &
  done
  wait
  tail -n 2 "$R"/distill_*.log
fi
echo "distill rows ready after $(( $(date +%s) - T0 ))s"

TRAIN_LEFT=$(( $(left) - ${TAIL_S:-70} ))
COMMON="--data $R/data --seq-len $SEQ --batch-size $BATCH --block-size 8 --blocks $BLOCKS --device $DEVICE
  --save-every-s $SAVE_S --eval-every 0 --log-every 25 --warmup-steps 50 --time-budget-s $TRAIN_LEFT $TRAIN_ARGS"
run() {  # name port args...
  local name=$1 port=$2; shift 2
  local resume=""; [ -f "$R/$name/resume.pt" ] && resume="--resume"
  python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m tools.train $COMMON --out "$R/$name" $resume "$@" \
    > "$R/$name.log" 2>&1
}
run d8sd 29511 --init "$D8" --lr "$LR" --max-steps 0 --share-plan "$R/d8sd/plan.json" --distill "$R/distill" --kl-weight "$KL" &
P1=$!
run d8cont 29512 --init "$D8" --lr "$LR" --max-steps 0 --steps-from "$R/d8sd/plan.json" &
P2=$!
run sft2mtp 29513 --init "$SFT" --lr "$LR_SFT" --max-steps "$SFT_STEPS" --warmup-steps 100 &
P3=$!
( while kill -0 $P1 2>/dev/null; do sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null; done ) &
wait $P1 $P2 $P3
echo "training done after $(( $(date +%s) - T0 ))s"
for r in d8sd d8cont sft2mtp; do echo "== $r"; grep -v "it/s\]" "$R/$r.log" | tail -n 4; done

# Quick GPU decode check (the CPU reference run on the workstation is the report).
if [ "$(left)" -gt 25 ] && [ "$GPUS" -gt 0 ]; then
  M=""; for r in d8sd d8cont sft2mtp; do [ -d "$R/$r/compact" ] && M="$M --model $r=$R/$r/compact"; done
  timeout $(( $(left) - 15 )) python -m tools.eval_quality --data "$R/data" --model "d8=$D8" $M --sections decoding \
    --device cuda --jobs 8 --prompts "$EVAL_PROMPTS" --max-new-tokens 128 --train-logs none \
    --json "$OUT/quick_eval.json" --md "$R/quick_eval.md" > "$R/quick_eval.log" 2>&1
  grep -E "^\| (d8|d8sd|d8cont|sft2mtp) \| (speculative|hybrid)" "$R/quick_eval.md"
fi

# What comes back (at most 8 files, each under 16 MiB).
for r in d8sd d8cont sft2mtp; do
  [ -d "$R/$r/compact" ] && tar czf "$OUT/$r.tgz" -C "$R/$r" compact train_log.json
done
cat "$R"/distill/distill_*.json > "$OUT/distill_meta.json" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$R" device.txt corpus.log $(cd "$R" && ls distill_*.log d8sd.log d8cont.log sft2mtp.log quick_eval.* 2>/dev/null)
ls -la "$OUT"
echo "all done after $(( $(date +%s) - T0 ))s"
