#!/usr/bin/env bash
# One device call (issue 14), two GPUs of one host: rebuild the corpus with the release
# tokenizer, record the teacher's own greedy continuations (one generator per GPU), then DDP
# trainings at once (torchrun, 2 processes each, sharing both GPUs). ROUND picks the recipes:
#   ROUND=1 (the first round, teacher = the release D = 8 model before self-distillation)
#     d8sd    the D8 model fine-tuned with self-distillation (distill rows + KL to the clean stream)
#     d8cont  the same steps on corpus rows only (the control: extra steps without distillation)
#   ROUND=2 (teacher refreshed from the student: the shipped self-distilled model)
#     d8sd2   D8 + its own continuations, slot weights $SLOTS, NTP on the distill rows' prompts
#     d8sd2m  the same with MTP weight $MTP_LOW (less pull on the backbone: the NTP gap)
#   ROUND=3 (teacher refreshed again: the shipped d8sd2; slot weights $SLOTS3 favour slots 0-2)
#     d8sd3   D8 + its own continuations, MTP weight $MTP_MID (the NTP gap without losing drafts)
#     d8sd3m  the same with MTP weight $MTP_LOW3
#     sft2sd  sft-27m -> BitMTP D = 8 with --init and self-distillation from the SFT model's own
#             greedy continuations ($SFT_ROWS rows): its budget is half the from-scratch model's
#             2,778 steps *including* the generation, counted at the from-scratch run's step rate
#             (2,778 steps in 389.2 s), so its steps are $SFT_STEPS - that generation's cost
#   ROUND 1/2: sft2mtp  sft-27m -> BitMTP D = 8 with --init, half the from-scratch model's 2,778
#           steps (starts as soon as the corpus is built: it needs no distill rows)
#   ROUND=4 (the held-out NTP gap; teacher = the shipped d8sd2; no SFT-side run): both continue
#           d8sd2 with no lr restart and no warm-up ($LR4 cosine down to a tenth), MTP weight
#           $MTP4, $ROWS distill rows, KL $KL, slot weights $SLOTS, NTP on the distill prompts,
#           each run fitting its own steps to the same wall-clock budget:
#     d8sd4    that continuation alone
#     d8sd4kd  the same + NTP distillation from sft-27m (--ntp-teacher, --ntp-kl-weight $NTP_KL):
#              its teacher's forward passes are paid from the same budget (fewer steps)
#   ROUND=5 (round 4's evidence: NTP distillation moves the gap and keeps the drafts): both
#           continue d8sd2 as round 4 did, with the whole NTP target from sft-27m's
#           distribution (--ntp-kl-weight $NTP_KL5) and the longest training one call holds:
#     d8sd5    MTP weight $MTP4 (d8sd4kd's, with the larger KL weight)
#     d8sd5m   MTP weight $MTP5_LOW (less pull of the blocks on the backbone)
#   ROUND=6 (five rounds held the D = 8 line 4.1-4.7% above SFT; sft2mtp kept NTP within 0.5%):
#           the SFT side with a full schedule, teacher = sft-27m (its own greedy continuations,
#           what a verifier near the SFT model will say), each run fitted to the same wall clock:
#     sft6     sft-27m --init -> BitMTP D = 8, self-distillation (KL $KL, slot weights $SLOTS,
#              NTP on the distill prompts), MTP weight 1.0, lr $LR_SFT
#     sft6kd   the same + NTP distillation from sft-27m (--ntp-kl-weight $NTP_KL): the student
#              starts at its teacher, so the KL holds it there
#     sftcont  the control: sft-27m continued on corpus rows alone (MTP weight 0) for sft6's
#              steps at the same lr: the SFT baseline with the same budget
#   ROUND=7 (six rounds: drafts good for >= 6 tokens per iteration cost the backbone 4-8% of held-out
#           NTP): capacity the clean stream never uses. sft-27m stays frozen, bit for bit; only
#           mask-row adapters (tools.train --adapter-rank) and a per-slot input offset train, on
#           sft-27m's own continuations (KL $KL, slot weights $SLOTS), for sftcont's $ADAPTER_STEPS
#           steps: round 6's equal-budget SFT baseline is then the NTP baseline of these models too
#     sft7r$RANK_LOW   rank $RANK_LOW adapters
#     sft7r$RANK_HIGH  rank $RANK_HIGH adapters
#   ROUND=8 (round 7: rank-32/128 adapters kept NTP exact but drafted 4.5-4.8 tokens per
#           iteration): the same frozen sft-27m, teacher and steps, with full-rank ternary twins of
#           the last layers' projections for the draft rows (tools.train --twin-layers): the draft
#           rows' own weights at two bits each (the last 4 layers: +50% of the projection bytes a
#           draft step reads; all 8: +100%, the capacity sft6 had, without touching the verifier)
#     sft8t$TWIN_LOW   twins of the last $TWIN_LOW layers
#     sft8t$TWIN_HIGH  twins of all $TWIN_HIGH layers
#   ROUND=9 (round 8: twins of all 8 layers drafted 4.84 tokens per iteration, rank-128 adapters
#           4.83, sft6 5.98 — its later slots far ahead: what the frozen history's keys and values
#           hold, not the draft rows' weights): round 8's twins, reading the history through their
#           own keys and values as well (tools.train --twin-kv; a second KV buffer at runtime)
#     sft9kv$TWIN_LOW   twins of the last $TWIN_LOW layers, their own keys and values
#     sft9kv$TWIN_HIGH  twins of all $TWIN_HIGH layers, their own keys and values
# then the decode check: EVAL=replay, the held-out NTP loss and the decoding replay of
# tools.eval_acceptance on the GPU ($EVAL_PROMPTS held-out, $DOC_PROMPTS docstring prompts) for the new
# models and the release model; EVAL=quick, a 10-prompt GPU run; EVAL=ntp, only the held-out NTP loss
# of the new models and the baselines (decoding is replayed on the CPU afterwards); EVAL=full, the report's evaluation on
# the GPU (float64 reference backend): every policy on $EVAL_PROMPTS held-out prompts and
# speculative / hybrid on the docstring set, for the release model (run beside the corpus
# build) and each new one (as soon as it is trained), then held-out NTP loss of all of them
# and the SFT baseline. Packs checkpoints, logs and eval JSON into $OUT (at most 8 files).
# Every run saves resume state each SAVE_S seconds: a cut-off run continues with --resume.
#
#   bash tools/h200_distill.sh 2>&1 | tee $OUT/session.log                  # on the device, repo root
#   ROUND=2 EVAL=full BUDGET=555 bash tools/h200_distill.sh 2>&1 | tee $OUT/session.log
#   ROUND=4 EVAL=ntp NPROC=1 BUDGET=450 ROWS=6144 GEN_BATCH=2048 bash tools/h200_distill.sh 2>&1 | tee $OUT/session.log
#   NPROC=2 BUDGET=300 SEQ=64 BATCH=8 BLOCKS=4 ROWS=16 GEN_BATCH=8 PROMPT=16 SFT_STEPS=6 \
#     EVAL_PROMPTS=2 DOC_PROMPTS=2 MAX_NEW=8 CORPUS_ARGS="--root a=/some/tree" DEVICE=cpu \
#     bash tools/h200_distill.sh                                              # CPU dry run
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
# NVLink multicast stays off on shared hosts (it can take the host's GPUs down for others).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s)
BUDGET=${BUDGET:-420}          # seconds until everything is packed
ROUND=${ROUND:-1}
EVAL=${EVAL:-quick}
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
SLOTS=${SLOTS:-2,2,2,1,1,1,1,1}  # round 2: hybrid's m = 3 test reads slots 0-2
MTP_LOW=${MTP_LOW:-0.5}
SLOTS3=${SLOTS3:-3,3,3,1,1,1,1,1}  # round 3: slots 0-2 weigh three times the others
MTP_MID=${MTP_MID:-0.75}
MTP_LOW3=${MTP_LOW3:-0.6}
SFT_ROWS=${SFT_ROWS:-4096}     # round 3: the SFT teacher's continuations for sft2sd
LR4=${LR4:-2e-4}               # round 4: d8sd2 ended its schedule at 6e-5; no restart to 6e-4
MTP4=${MTP4:-0.5}
NTP_KL=${NTP_KL:-0.5}          # round 4: share of the NTP target from the SFT model's distribution
NTP_KL5=${NTP_KL5:-1.0}        # round 5: all of it
MTP5_LOW=${MTP5_LOW:-0.35}
RANK_LOW=${RANK_LOW:-32}       # round 7: adapter ranks (bf16 bytes per draft step: rank 32 ~ 0.7x the
RANK_HIGH=${RANK_HIGH:-128}    # 27M model's packed ternary weights, rank 128 ~ 2.8x)
LR_ADAPTER=${LR_ADAPTER:-2e-3}
TWIN_LOW=${TWIN_LOW:-4}        # rounds 8-9: twinned layers (of 8)
TWIN_HIGH=${TWIN_HIGH:-8}
ADAPTER_STEPS=${ADAPTER_STEPS:-1448}  # round 6's sftcont: sft-27m + 1,448 corpus steps, held-out NTP 2.2324
SCRATCH_RATE=${SCRATCH_RATE:-7.138}  # steps/s of the from-scratch D = 8 run (2,778 in 389.2 s)
SAVE_S=${SAVE_S:-60}
EVAL_PROMPTS=${EVAL_PROMPTS:-40}
DOC_PROMPTS=${DOC_PROMPTS:-20}
MAX_NEW=${MAX_NEW:-128}
EVAL_JOBS=${EVAL_JOBS:-12}
NTP_WINDOWS=${NTP_WINDOWS:-128}  # held-out NTP loss: 512-token windows of the test split
REPLAY_JOBS=${REPLAY_JOBS:-8}  # EVAL=replay: processes sharing the prompts (one at a time they took 137 s for 40)
CORPUS_ARGS=${CORPUS_ARGS:-}
BASELINES=${BASELINES:-}       # EVAL=full: more NAME=CKPT evaluated beside the release model
TRAIN_ARGS=${TRAIN_ARGS:-}
D8=tools/checkpoints/bitmtp-d8-27m
SFT=tools/checkpoints/sft-27m
TEACHER=${TEACHER:-$D8}
RELEASE_DATA=tools/checkpoints/data   # the release test split and held-out prompts
DOCS=tools/results/docstring_prompts.jsonl
SFTRUN=sft2mtp
case $ROUND in
  1) RUNS="d8sd d8cont" ;;
  2) RUNS="d8sd2 d8sd2m" ;;
  3) RUNS="d8sd3 d8sd3m"; SFTRUN=sft2sd ;;
  4) RUNS="d8sd4 d8sd4kd"; SFTRUN= ;;
  5) RUNS="d8sd5 d8sd5m"; SFTRUN= ;;
  6) RUNS="sft6 sft6kd sftcont"; SFTRUN=; TEACHER=$SFT ;;
  7) RUNS="sft7r$RANK_LOW sft7r$RANK_HIGH"; SFTRUN=; TEACHER=$SFT ;;
  8) RUNS="sft8t$TWIN_LOW sft8t$TWIN_HIGH"; SFTRUN=; TEACHER=$SFT ;;
  9) RUNS="sft9kv$TWIN_LOW sft9kv$TWIN_HIGH"; SFTRUN=; TEACHER=$SFT ;;
  *) echo "ROUND=$ROUND: choose 1, 2, 3, 4, 5, 6, 7, 8 or 9" >&2; exit 2 ;;
esac
case $EVAL in quick|ntp|replay|full) ;; *) echo "EVAL=$EVAL: choose quick, ntp, replay or full" >&2; exit 2 ;; esac
TAIL_GIVEN=${TAIL_S:-}         # seconds kept after training (EVAL=full: fitted to the release eval unless given)
if [ "$EVAL" = full ]; then TAIL_S=${TAIL_S:-150}; else TAIL_S=${TAIL_S:-70}; fi
mkdir -p "$R/eval" "$OUT"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU") | tee "$R/device.txt"
python -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], 'gpus', torch.cuda.device_count())" | tee -a "$R/device.txt"
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
EVAL_DEVICE=$([ "$GPUS" -gt 0 ] && echo cuda || echo cpu)

# evaluate TAG NAME=CKPT...: every policy on the held-out prompts and, at the same time,
# speculative / hybrid (and ar, their reference) on the docstring set; each writes its JSON
# when complete, and TAG's wall time goes to $R/eval/TAG.wall_s.
evaluate() {
  local tag=$1 t=$(date +%s); shift
  local m=""; for spec in "$@"; do m="$m --model $spec"; done
  local common="--device $EVAL_DEVICE --jobs $EVAL_JOBS --chunk 5 --max-new-tokens $MAX_NEW --train-logs none"
  timeout $(( $(left) - 12 )) python -m tools.eval_quality --data "$RELEASE_DATA" $m --sections decoding $common \
    --prompts "$EVAL_PROMPTS" --policies confidence,speculative,hybrid --json "$R/eval/heldout_$tag.json" \
    --md "$R/eval/heldout_$tag.md" > "$R/eval/heldout_$tag.log" 2>&1 &
  timeout $(( $(left) - 12 )) python -m tools.eval_quality --data "$RELEASE_DATA" $m --sections decoding $common \
    --prompts "$DOC_PROMPTS" --prompt-file "$DOCS" --policies speculative,hybrid --json "$R/eval/doc_$tag.json" \
    --md "$R/eval/doc_$tag.md" > "$R/eval/doc_$tag.log" 2>&1
  wait
  echo $(( $(date +%s) - t )) > "$R/eval/$tag.wall_s"
  echo "eval $tag done after $(( $(date +%s) - T0 ))s ($(cat "$R/eval/$tag.wall_s")s)"
  grep -hE "^\| [a-z0-9]+ \| (ar|confidence|speculative|hybrid) \|" "$R/eval/heldout_$tag.md" "$R/eval/doc_$tag.md" 2>/dev/null
}
if [ "$EVAL" = full ]; then  # the release model needs nothing built: beside the corpus build
  # shellcheck disable=SC2086
  evaluate release "d8=$D8" $BASELINES &
  E0=$!
fi

if [ ! -f "$R/data/corpus.json" ]; then
  python -m tools.corpus build --out "$R/data" --tokenizer "$D8" $CORPUS_ARGS 2>&1 | tee "$R/corpus.log" || exit 1
fi
python -m tools.corpus compare "$R/data" | tee -a "$R/corpus.log"
echo "corpus ready after $(( $(date +%s) - T0 ))s"

COMMON="--data $R/data --seq-len $SEQ --batch-size $BATCH --block-size 8 --blocks $BLOCKS --device $DEVICE
  --save-every-s $SAVE_S --eval-every 0 --log-every 25 --warmup-steps 50 $TRAIN_ARGS"
run() {  # name args...
  local name=$1; shift
  local resume=""; [ -f "$R/$name/resume.pt" ] && resume="--resume"
  python -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m tools.train $COMMON --out "$R/$name" \
    --time-budget-s $(( $(left) - TAIL_S )) $resume "$@" > "$R/$name.log" 2>&1
}
if [ "$ROUND" = 3 ]; then
  # The SFT model's own continuations, beside the D = 8 teacher's; sft2sd starts when they are
  # there, its steps cut by what their generation cost (at the from-scratch run's step rate).
  (
    if [ ! -f "$R/distill_sft/rows_000.npy" ]; then
      python -m tools.distill --teacher "$SFT" --data "$R/data" --out "$R/distill_sft" --rows "$SFT_ROWS" \
        --prompt-len "$PROMPT" --seq-len "$SEQ" --batch "$GEN_BATCH" --device "$DEVICE" > "$R/distill_sft.log" 2>&1 || exit 1
    fi
    GEN_S=$(python -c "import json; print(json.load(open('$R/distill_sft/distill_000.json'))['generate_s'])")
    STEPS=$(python -c "import math; print($SFT_STEPS - math.ceil($GEN_S * $SCRATCH_RATE))")
    echo "sft2sd: SFT continuations generated in ${GEN_S}s = $(( SFT_STEPS - STEPS )) steps of the from-scratch run; training $STEPS steps"
    if [ "$STEPS" -lt 1 ]; then echo "sft2sd: no steps left in its budget; not trained"; exit 0; fi
    run sft2sd --init "$SFT" --lr "$LR_SFT" --max-steps "$STEPS" --warmup-steps 100 --distill "$R/distill_sft" \
      --kl-weight "$KL" --slot-weights "$SLOTS" --distill-ntp prompt
  ) &
  P0=$!
elif [ -n "$SFTRUN" ]; then
  # No distill rows needed: it trains while the teacher generates.
  run sft2mtp --init "$SFT" --lr "$LR_SFT" --max-steps "$SFT_STEPS" --warmup-steps 100 &
  P0=$!
fi

if [ ! -f "$R/distill/rows_000.npy" ]; then
  GEN=""
  for s in $(seq 0 $(( NPROC - 1 ))); do
    CUDA_VISIBLE_DEVICES=$(( GPUS > 0 ? s % GPUS : 0 )) python -m tools.distill --teacher "$TEACHER" --data "$R/data" \
      --out "$R/distill" --rows "$ROWS" --prompt-len "$PROMPT" --seq-len "$SEQ" --batch "$GEN_BATCH" --shard "$s" \
      --device "$DEVICE" > "$R/distill_$s.log" 2>&1 &
    GEN="$GEN $!"
  done
  wait $GEN
  tail -n 2 "$R"/distill_*.log
fi
echo "distill rows ready after $(( $(date +%s) - T0 ))s"

if [ "$EVAL" = full ] && [ -f "$R/eval/release.wall_s" ] && [ -z "$TAIL_GIVEN" ]; then
  # The new models' evaluation costs what the release models' did (same count, same work):
  # leave it that much time after training, plus the held-out loss and packing.
  TAIL_S=$(( $(cat "$R/eval/release.wall_s") + 35 ))
  TAIL_S=$(( TAIL_S < 100 ? 100 : TAIL_S > 220 ? 220 : TAIL_S ))
  echo "evaluation tail: ${TAIL_S}s"
fi
if [ "$ROUND" = 1 ]; then
  run d8sd --init "$D8" --lr "$LR" --max-steps 0 --share-plan "$R/d8sd/plan.json" --distill "$R/distill" --kl-weight "$KL" &
  P1=$!
  run d8cont --init "$D8" --lr "$LR" --max-steps 0 --steps-from "$R/d8sd/plan.json" &
  P2=$!
elif [ "$ROUND" = 4 ]; then
  # No share-plan: each run fits its own steps, so the teacher's forward passes cost d8sd4kd steps.
  SD="--init $D8 --lr $LR4 --warmup-steps 0 --mtp-weight $MTP4 --distill $R/distill --kl-weight $KL
    --slot-weights $SLOTS --distill-ntp prompt --max-steps 0"
  run d8sd4 $SD &
  P1=$!
  run d8sd4kd $SD --ntp-teacher "$SFT" --ntp-kl-weight "$NTP_KL" &
  P2=$!
elif [ "$ROUND" = 5 ]; then
  SD="--init $D8 --lr $LR4 --warmup-steps 0 --distill $R/distill --kl-weight $KL --slot-weights $SLOTS
    --distill-ntp prompt --max-steps 0 --ntp-teacher $SFT --ntp-kl-weight $NTP_KL5"
  run d8sd5 $SD --mtp-weight "$MTP4" &
  P1=$!
  run d8sd5m $SD --mtp-weight "$MTP5_LOW" &
  P2=$!
elif [ "$ROUND" = 6 ]; then
  SD="--init $SFT --lr $LR_SFT --warmup-steps 100 --max-steps 0"
  DS="--distill $R/distill --kl-weight $KL --slot-weights $SLOTS --distill-ntp prompt"
  run sft6 $SD $DS --share-plan "$R/sft6/plan.json" &
  P1=$!
  run sft6kd $SD $DS --ntp-teacher "$SFT" --ntp-kl-weight "$NTP_KL" &
  P2=$!
  run sftcont $SD --mtp-weight 0 --steps-from "$R/sft6/plan.json" &
  P3=$!
elif [ "$ROUND" = 7 ] || [ "$ROUND" = 8 ] || [ "$ROUND" = 9 ]; then
  # the mask rows' own capacity on a frozen sft-27m, two sizes at once: adapters (7), twins (8),
  # twins with their own keys and values of the history (9)
  AD="--init $SFT --lr $LR_ADAPTER --warmup-steps 100 --max-steps $ADAPTER_STEPS --distill $R/distill --kl-weight $KL
    --slot-weights $SLOTS --distill-ntp prompt"
  if [ "$ROUND" = 7 ]; then FLAG=--adapter-rank; TAG=r; LOW=$RANK_LOW; HIGH=$RANK_HIGH
  elif [ "$ROUND" = 8 ]; then FLAG=--twin-layers; TAG=t; LOW=$TWIN_LOW; HIGH=$TWIN_HIGH
  else FLAG=--twin-layers; TAG=kv; LOW=$TWIN_LOW; HIGH=$TWIN_HIGH; AD="$AD --twin-kv"; fi
  run "sft$ROUND$TAG$LOW" $AD $FLAG "$LOW" &
  P1=$!
  run "sft$ROUND$TAG$HIGH" $AD $FLAG "$HIGH" &
  P2=$!
elif [ "$ROUND" = 2 ]; then
  SD="--init $D8 --lr $LR --distill $R/distill --kl-weight $KL --slot-weights $SLOTS --distill-ntp prompt"
  run d8sd2 $SD --max-steps 0 --share-plan "$R/d8sd2/plan.json" &
  P1=$!
  run d8sd2m $SD --mtp-weight "$MTP_LOW" --max-steps 0 --steps-from "$R/d8sd2/plan.json" &
  P2=$!
else
  SD="--init $D8 --lr $LR --distill $R/distill --kl-weight $KL --slot-weights $SLOTS3 --distill-ntp prompt"
  run d8sd3 $SD --mtp-weight "$MTP_MID" --max-steps 0 --share-plan "$R/d8sd3/plan.json" &
  P1=$!
  run d8sd3m $SD --mtp-weight "$MTP_LOW3" --max-steps 0 --steps-from "$R/d8sd3/plan.json" &
  P2=$!
fi
( while kill -0 $P1 2>/dev/null; do sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null; done ) &
if [ -n "$SFTRUN" ]; then
  wait $P0
  echo "$SFTRUN done after $(( $(date +%s) - T0 ))s"
fi
if [ "$EVAL" = full ] && [ -n "$SFTRUN" ] && [ -d "$R/$SFTRUN/compact" ]; then
  evaluate $SFTRUN "$SFTRUN=$R/$SFTRUN/compact" &
  E1=$!
fi
wait $P1 $P2 ${P3:-}
echo "training done after $(( $(date +%s) - T0 ))s"
# The checkpoints are what this call is for: packed before any evaluation can run into the budget.
for r in $SFTRUN $RUNS; do
  [ -d "$R/$r/compact" ] && tar czf "$OUT/$r.tgz" -C "$R/$r" compact train_log.json
  # a file comes back from the device only under 16 MiB (rank-128 adapters make ~25): in parts,
  # joined with `cat NAME.tgz.part-* > NAME.tgz`
  if [ -f "$OUT/$r.tgz" ] && [ "$(stat -c %s "$OUT/$r.tgz")" -gt 15728640 ]; then
    split -b 15M "$OUT/$r.tgz" "$OUT/$r.tgz.part-" && rm "$OUT/$r.tgz"
  fi
done
for r in $SFTRUN $RUNS; do echo "== $r"; grep -v "it/s\]" "$R/$r.log" | tail -n 4; done

if [ "$EVAL" = full ] || [ "$EVAL" = ntp ] || [ "$EVAL" = replay ]; then
  if [ "$EVAL" = full ]; then
    M=""; for r in $RUNS; do [ -d "$R/$r/compact" ] && M="$M $r=$R/$r/compact"; done
    # shellcheck disable=SC2086
    [ -n "$M" ] && evaluate round$ROUND $M &
    E2=$!
  fi
  H="--model sft=$SFT --model d8=$D8"; for b in $BASELINES; do H="$H --model $b"; done
  for r in $SFTRUN $RUNS; do [ -d "$R/$r/compact" ] && H="$H --model $r=$R/$r/compact"; done
  timeout $(( $(left) - 12 )) python -m tools.eval_quality --data "$RELEASE_DATA" $H --sections heldout \
    --device "$EVAL_DEVICE" --max-windows "$NTP_WINDOWS" --train-logs none --json "$R/eval/ntp.json" \
    --md "$R/eval/ntp.md" > "$R/eval/ntp.log" 2>&1
  grep -E "^\| [a-z0-9]+ \| [0-9.]+ \|" "$R/eval/ntp.md"
  [ "$EVAL" = full ] && wait ${E0:-} ${E1:-} $E2
  if [ "$EVAL" = replay ]; then  # every model with blocks; the release model is the control
    A="--model d8=$D8"
    for r in $SFTRUN $RUNS; do [ -f "$R/$r/compact/bitmtp.json" ] && A="$A --model $r=$R/$r/compact"; done
    RD=$([ "$GPUS" -gt 0 ] && echo cuda || echo cpu)
    timeout $(( $(left) - 12 )) python -m tools.eval_acceptance --data "$RELEASE_DATA" $A --prompts "$EVAL_PROMPTS" \
      --max-new-tokens "$MAX_NEW" --device "$RD" --jobs "$REPLAY_JOBS" --json "$R/eval/replay_heldout.json" > "$R/eval/replay_heldout.log" 2>&1
    tail -n 12 "$R/eval/replay_heldout.log"
    timeout $(( $(left) - 10 )) python -m tools.eval_acceptance --data "$RELEASE_DATA" $A --prompts "$DOC_PROMPTS" \
      --prompt-file "$DOCS" --max-new-tokens "$MAX_NEW" --device "$RD" --jobs "$REPLAY_JOBS" --json "$R/eval/replay_doc.json" \
      > "$R/eval/replay_doc.log" 2>&1
    tail -n 12 "$R/eval/replay_doc.log"
  fi
  echo "evaluation done after $(( $(date +%s) - T0 ))s"
elif [ "$(left)" -gt 25 ] && [ "$GPUS" -gt 0 ]; then  # quick GPU decode check
  M="--model d8=$D8"; for r in $SFTRUN $RUNS; do [ -d "$R/$r/compact" ] && M="$M --model $r=$R/$r/compact"; done
  timeout $(( $(left) - 15 )) python -m tools.eval_quality --data "$R/data" $M --sections decoding \
    --device cuda --jobs 8 --prompts 10 --max-new-tokens 128 --train-logs none \
    --json "$R/eval/quick_eval.json" --md "$R/eval/quick_eval.md" > "$R/eval/quick_eval.log" 2>&1
  grep -E "^\| [a-z0-9]+ \| (speculative|hybrid)" "$R/eval/quick_eval.md"
fi

# What else comes back (at most 8 files, each under 16 MiB).
cat "$R"/distill/distill_*.json "$R"/distill_sft/distill_*.json > "$OUT/distill_meta.json" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$R" device.txt corpus.log eval $(cd "$R" && ls distill_*.log $SFTRUN.log $(for r in $RUNS; do echo "$r.log"; done) 2>/dev/null)
ls -la "$OUT"
echo "all done after $(( $(date +%s) - T0 ))s"
