#!/usr/bin/env bash
# One device call (issue 3): build the corpus + tokenizer from this machine's stdlib and
# site-packages, then train the SFT baseline and BitMTP D=8 and D=4 *concurrently* on the
# one GPU (same size, data and steps: D=8 fits its step count to the budget and the others
# adopt it), and leave compact checkpoints, logs and the held-out data in $OUT.
#
#   bash tools/h200_train.sh                       # on the H200 (run from the repo root)
#   BUDGET=240 PRESET=tiny SEQ=64 BATCH=8 D8_BLOCKS=4 D4_BLOCKS=8 CORPUS_ARGS="--root a=/some/tree" bash tools/h200_train.sh   # CPU dry run
#
# BUDGET: seconds from start until every trainer must have saved (corpus build included).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
T0=$(date +%s)
BUDGET=${BUDGET:-540}
R=${R:-runs/h200}
OUT=${OUT:-runs/h200_out}
PRESET=${PRESET:-base27m}
SEQ=${SEQ:-512}
BATCH=${BATCH:-64}
D8_BLOCKS=${D8_BLOCKS:-40}
D4_BLOCKS=${D4_BLOCKS:-80}
CORPUS_ARGS=${CORPUS_ARGS:-}
TRAIN_ARGS=${TRAIN_ARGS:-}
mkdir -p "$R" "$OUT"
(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no GPU") | tee "$R/device.txt"
python -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0], 'cuda', torch.cuda.is_available())" | tee -a "$R/device.txt"

if [ ! -f "$R/data/corpus.json" ]; then
  python -m tools.corpus build --out "$R/data" $CORPUS_ARGS 2>&1 | tee "$R/corpus.log" || exit 1
fi
LEFT=$(( BUDGET - ($(date +%s) - T0) ))
echo "corpus ready after $(( $(date +%s) - T0 ))s; training budget ${LEFT}s"

COMMON="--data $R/data --preset $PRESET --seq-len $SEQ --batch-size $BATCH --max-steps 0 --time-budget-s $LEFT $TRAIN_ARGS"
python -m tools.train $COMMON --out "$R/d8" --block-size 8 --blocks $D8_BLOCKS --share-plan "$R/d8/plan.json" > "$R/d8.log" 2>&1 &
P8=$!
python -m tools.train $COMMON --out "$R/d4" --block-size 4 --blocks $D4_BLOCKS --steps-from "$R/d8/plan.json" > "$R/d4.log" 2>&1 &
P4=$!
python -m tools.train $COMMON --out "$R/sft" --mtp-weight 0 --steps-from "$R/d8/plan.json" > "$R/sft.log" 2>&1 &
PS=$!
( while kill -0 $P8 2>/dev/null; do sleep 60; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null; done ) &
wait $P8 $P4 $PS
echo "training done after $(( $(date +%s) - T0 ))s"
for r in d8 d4 sft; do echo "== $r"; grep -v "it/s\]" "$R/$r.log" | tail -n 6; done

# What comes back (at most 8 files, each under 16 MiB): compact checkpoints, logs, held-out data.
for r in d8 d4 sft; do
  [ -d "$R/$r/compact" ] && tar czf "$OUT/$r.tgz" -C "$R/$r" compact train_log.json $( [ -f "$R/$r/plan.json" ] && echo plan.json )
done
tar czf "$OUT/data.tgz" -C "$R/data" corpus.json files.tsv tokenizer.json tokenizer_config.json special_tokens_map.json \
  prompts.jsonl $(cd "$R/data" && ls val_*.bin test_*.bin)
tar czf "$OUT/logs.tgz" -C "$R" device.txt corpus.log d8.log d4.log sft.log
ls -la "$OUT"
echo "all done after $(( $(date +%s) - T0 ))s"
