#!/usr/bin/env bash
# The SmolLM2-135M-Instruct recipe: the target writes its own training conversations,
# they are tokenized, a drafter is trained and measured by real speculative decoding.
#
#   bash scripts/smollm2_recipe.sh                       # the full recipe (one GPU)
#   GEN_LIMIT=100 TRAIN_MINUTES=2 bash scripts/smollm2_recipe.sh   # time-boxed
#
# Every step is resumable or idempotent: run it again after an interruption.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${TARGET:-builtin}          # builtin, a model directory or a .gguf file
WORK=${WORK:-runs/smollm2}
N_SYNTH=${N_SYNTH:-100000}         # self-instructed conversations to write
MAX_NEW=${MAX_NEW:-512}            # answer length limit (tokens)
SLOTS=${SLOTS:-256}                # generation batch (continuous batching slots)
GEN_LIMIT=${GEN_LIMIT:-0}          # stop generating after this many seconds (0 = no limit)
TRAIN_MINUTES=${TRAIN_MINUTES:-0}  # stop training after this many minutes (0 = the config's limit)
EVAL_PROMPTS=${EVAL_PROMPTS:-0}    # prompts per eval set (0 = all)
EVAL_NEW=${EVAL_NEW:-256}
# SKIP_EVAL=1: stop after training (the trainer already measured tau on held-out prompts)
PY=${PYTHON:-python3}
DFT="$PY -m dflash_train"
mkdir -p "$WORK"

echo "== 1/4 generate: $N_SYNTH self-instructed conversations (target: $TARGET)"
GEN=($DFT generate --target "$TARGET" --synthesize "$N_SYNTH" --output "$WORK/synth.jsonl"
     --max-new-tokens "$MAX_NEW" --batch-size "$SLOTS" --seed 1 --progress false)
if [ "$GEN_LIMIT" -gt 0 ]; then
  timeout --signal=TERM --kill-after=20 "$GEN_LIMIT" "${GEN[@]}" || echo "generation stopped after ${GEN_LIMIT}s (resumable)"
else
  "${GEN[@]}"
fi
echo "   $(wc -l < "$WORK/synth.jsonl") conversations in $WORK/synth.jsonl"

echo "== 2/4 prepare"
$DFT prepare "$WORK/synth.jsonl" --target "$TARGET" --output "$WORK/data" --overwrite --no-progress

echo "== 3/4 train"
EXTRA=()
[ "$TRAIN_MINUTES" != "0" ] && EXTRA+=(--run.max_minutes "$TRAIN_MINUTES")
RESUME=()
[ -d "$WORK/train/checkpoints" ] && RESUME+=(--resume)
$DFT train --config configs/smollm2-135m.yaml --target.path "$TARGET" --data.path "$WORK/data" \
    --run.output_dir "$WORK/train" --run.progress false "${EXTRA[@]}" "${RESUME[@]}" ${TRAIN_ARGS:-}

[ "${SKIP_EVAL:-0}" = "1" ] && exit 0
echo "== 4/4 eval (greedy, block 16)"
for prompts in humaneval chat; do
  $DFT eval --target "$TARGET" --drafter "$WORK/train/final" --prompts "$prompts" --num-prompts "$EVAL_PROMPTS" \
      --max-new-tokens "$EVAL_NEW" --output "$WORK/eval-$prompts" --no-progress
done
