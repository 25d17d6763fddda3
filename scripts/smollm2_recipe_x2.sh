#!/usr/bin/env bash
# The SmolLM2-135M-Instruct recipe on diverse prompts, one or two GPUs
# (docs/recipe-smollm2.md): prompt files from offline sources, answers written by the target
# (one `generate` per GPU on disjoint shards), prepare, train (torchrun, colocated), eval.
#
#   bash scripts/smollm2_recipe_x2.sh                         # everything, all visible GPUs (1 or 2)
#   STEPS="prompts generate" GEN_LIMIT=300 bash scripts/smollm2_recipe_x2.sh
#
# Every step is resumable or idempotent: rerun after an interruption (prompts: kept when built
# with the same options; generate: appends and skips finished rows; prepare: redone only when the
# generated files are newer; train: --resume from the last checkpoint, skipped once final/ exists;
# eval: a set with a report.json is skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${TARGET:-builtin}
WORK=${WORK:-runs/smollm2-x2}
CONFIG=${CONFIG:-configs/smollm2-135m-diverse.yaml}
NGPU=${NGPU:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}; [ "$NGPU" -ge 1 ] || NGPU=1
STEPS=${STEPS:-prompts generate prepare train eval}
PER_SOURCE=${PER_SOURCE:-0}        # training prompts kept per source (0 = all)
N_MATH=${N_MATH:-20000}            # math problems generated
N_SYNTH=${N_SYNTH:-100000}         # self-instructed conversations (split over the GPUs): chats lift the chat set, and
                                   # once the prompt files are answered, synthesis is what adds conversations
GEN_FILES=${GEN_FILES:-1}          # 0: generate only self-instructed chats (no prompt files): the chat set's data
MAX_NEW=${MAX_NEW:-512}            # answer length limit (tokens)
# generation slots per GPU: 1536 where the GPU has >= 120 GB (the KV cache takes 84 GiB; H200: 31.6K new tok/s
# against 25.0K at 768 in one 70-s probe each), else 768 (42 GiB)
GPU_MB=$( (nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null || echo 0) | head -1)
SLOTS=${SLOTS:-$([ "${GPU_MB:-0}" -ge 120000 ] 2>/dev/null && echo 1536 || echo 768)}
GEN_ATTENTION=${GEN_ATTENTION:-auto}  # generation's decode attention: auto (flex on a GPU), dense or flex (generate --attention)
GEN_LIMIT=${GEN_LIMIT:-0}          # stop generating after this many seconds (0 = no limit; resumable)
TRAIN_MINUTES=${TRAIN_MINUTES:-0}  # 0 = the config's run.max_minutes
MIX=${MIX:-}                       # data mix of the training rows, SOURCE=WEIGHT,... (scripts/split_generated.py --weights)
EVAL_NEW=${EVAL_NEW:-256}
EVAL_PROMPTS=${EVAL_PROMPTS:-0}     # HumanEval and chat prompts in the eval (0 = all)
EVAL_SOURCE_PROMPTS=${EVAL_SOURCE_PROMPTS:-64}  # held-out (and training) prompts per source in the eval
TIMING_REPEATS=${TIMING_REPEATS:-1}  # timed decodes per prompt in the greedy sets (eval --timing-repeats; 3 gives
                                     # the speedup's spread at 3x the eval's time)
PY=${PYTHON:-python3}
DFT="$PY -m dflash_train"
mkdir -p "$WORK/gen"
has() { [[ " $STEPS " == *" $1 "* ]]; }
gpu_env() { if [ "$NGPU" -gt 1 ]; then echo "CUDA_VISIBLE_DEVICES=$1"; fi; }

if has prompts; then
  echo "== prompts: code, docs, long documents, math from offline sources ($NGPU shard(s))"
  $DFT prompts --output "$WORK/prompts" --shards "$NGPU" --seed 0 --math-count "$N_MATH" --limit "$PER_SOURCE"
fi

if has generate; then
  echo "== generate: $NGPU process(es), one per GPU, disjoint shards (+ $N_SYNTH self-instructed)"
  pids=()
  for k in $(seq 0 $((NGPU - 1))); do
    if [ "$NGPU" -gt 1 ]; then shard=("$WORK"/prompts/train/*-"${k}of${NGPU}".jsonl); else shard=("$WORK"/prompts/train/*.jsonl); fi
    held=(); [ "$k" -eq 0 ] && held=("$WORK"/prompts/heldout/*-heldout.jsonl)   # small (needed by eval): --mix finishes them early
    files=(--prompts "${held[@]}" "${shard[@]}"); [ "$GEN_FILES" = 0 ] && files=()
    cmd=($DFT generate --target "$TARGET" "${files[@]}" --synthesize $((N_SYNTH / NGPU))
         --seed $((k + 1)) --output "$WORK/gen/gen-$k.jsonl" --max-new-tokens "$MAX_NEW" --batch-size "$SLOTS"
         --mix true --progress false --log-every-seconds 30 --attention "$GEN_ATTENTION" --summary json)
    # the time box ends the run cleanly (rows in flight finished, summary printed); `timeout` is
    # only the safety net for a run that does not end by itself
    [ "$GEN_LIMIT" -gt 0 ] && cmd=(timeout --signal=TERM --kill-after=30 $((GEN_LIMIT + 90)) "${cmd[@]}"
                                   --max-minutes "$(awk "BEGIN {print $GEN_LIMIT / 60}")")
    (env $(gpu_env "$k") "${cmd[@]}" > "$WORK/gen/gen-$k.log" 2>&1 || echo "generate $k stopped (rc=$?; resumable)") &
    pids+=($!)
  done
  wait "${pids[@]}"
  tail -n 3 "$WORK"/gen/gen-*.log || true
fi

if has prepare; then
  echo "== training rows near a held-out prompt left out, HumanEval guard on every user turn, then prepare"
  # every held-out prompt file, not only the chat set: conversations generated from an earlier build
  # of the prompt files may answer a prompt that this build holds out
  exclude=(--exclude chat)
  for f in "$WORK"/prompts/heldout/*-heldout.jsonl; do if [ -s "$f" ]; then exclude+=(--exclude "$f"); fi; done
  $PY scripts/split_generated.py "$WORK/gen/train.jsonl" "$WORK/gen/heldout.jsonl" "$WORK"/gen/gen-*.jsonl \
    "${exclude[@]}" ${MIX:+--weights "$MIX"}
  $DFT prompts --check "$WORK/gen/train.jsonl"
  for part in train heldout; do
    out=$WORK/data; [ "$part" = heldout ] && out=$WORK/data-heldout
    if [ -f "$out/manifest.json" ] && [ "$out/manifest.json" -nt "$WORK/gen/$part.jsonl" ]; then
      echo "   $out is up to date"; continue
    fi
    $DFT prepare "$WORK/gen/$part.jsonl" --target "$TARGET" --output "$out" --overwrite --no-progress --skip-bad-rows
  done
fi

if has train; then
  if [ -f "$WORK/train/final/model.safetensors" ]; then
    echo "== train: $WORK/train/final exists (remove it to train again)"
  else
    echo "== train: $NGPU GPU(s), colocated"
    EXTRA=(); [ "$TRAIN_MINUTES" != "0" ] && EXTRA+=(--run.max_minutes "$TRAIN_MINUTES")
    [ -d "$WORK/train/checkpoints" ] && EXTRA+=(--resume)
    LAUNCH=($PY -m dflash_train)
    [ "$NGPU" -gt 1 ] && LAUNCH=($PY -m torch.distributed.run --standalone --nproc-per-node "$NGPU" -m dflash_train)
    "${LAUNCH[@]}" train --config "$CONFIG" --target.path "$TARGET" --data.path "$WORK/data" \
      --data.eval_path "$WORK/data-heldout" --run.output_dir "$WORK/train" --run.progress false "${EXTRA[@]}" ${TRAIN_ARGS:-}
  fi
fi

if has eval; then
  echo "== eval (greedy, block of the drafter): HumanEval 164 x $EVAL_NEW, held-out chat, held-out and training prompts of the sources"
  D=$WORK/train/final
  # The first $EVAL_SOURCE_PROMPTS prompts of every source in one file per side (ids keep the
  # source): one engine start-up each, the per-source tau read back from the report's ids.
  mkdir -p "$WORK/eval-sets"
  for side in heldout train; do
    files=("$WORK"/prompts/heldout/*-heldout.jsonl)
    [ "$side" = train ] && files=("$WORK"/prompts/train/*.jsonl)
    for f in "${files[@]}"; do
      [ "$side" = train ] && [ "$NGPU" -gt 1 ] && [[ $f != *-0of"$NGPU".jsonl ]] && continue
      head -n "$EVAL_SOURCE_PROMPTS" "$f"
    done > "$WORK/eval-sets/sources-$side.jsonl"
  done
  # training prompts: their answers were trained on (memorisation check against held-out)
  sets=("humaneval:$EVAL_PROMPTS:greedy" "chat:$EVAL_PROMPTS:greedy" "$WORK/eval-sets/sources-heldout.jsonl:0:no-greedy"
        "$WORK/eval-sets/sources-train.jsonl:0:no-greedy")
  run_set() {  # set spec PROMPTS:N:greedy|no-greedy
    local spec=$1 name n mode
    mode=${spec##*:}; spec=${spec%:*}; n=${spec##*:}; spec=${spec%:*}; name=$(basename "$spec" .jsonl)
    [ -f "$WORK/eval-$name/report.json" ] && { echo "   eval-$name done"; return; }
    $DFT eval --target "$TARGET" --drafter "$D" --prompts "$spec" --num-prompts "$n" --max-new-tokens "$EVAL_NEW" \
      --"$mode" --timing-repeats "$TIMING_REPEATS" --output "$WORK/eval-$name" --no-progress > "$WORK/eval-$name.log" 2>&1 || echo "   eval-$name failed (rc=$?)"
  }
  for k in $(seq 0 $((NGPU - 1))); do
    ( [ "$NGPU" -gt 1 ] && export CUDA_VISIBLE_DEVICES=$k; i=0
      for s in "${sets[@]}"; do [ $((i % NGPU)) -eq "$k" ] && run_set "$s"; i=$((i + 1)); done ) &
  done
  wait
  $PY scripts/recipe_eval_summary.py "$WORK"
fi
