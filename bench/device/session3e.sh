#!/usr/bin/env bash
# H200 session 3, call E (right after D, the trained drafter in /tmp): real speculative decoding
# of the recipe's drafter on HumanEval (164 x 256) and the built-in held-out chat prompts, and
# the engine's batch-1 / batched speed with a trained drafter (issue 15 registry keys).
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/eval.log; W=/tmp/smolrun; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
D=$W/train/final
if [ ! -f $D/model.safetensors ]; then echo "no trained drafter in $D" | tee -a $LOG; exit 3; fi
stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a $LOG
  timeout --signal=TERM --kill-after=10 $limit "$@" >> $LOG 2>&1
  echo "=== $name rc=$? $(date +%T)" | tee -a $LOG
}
stage eval_humaneval 200 python3 -m dflash_train eval --target /tmp/smol/hf --drafter $D --prompts humaneval \
  --max-new-tokens 256 --output $W/eval-humaneval --no-progress
stage eval_chat 120 python3 -m dflash_train eval --target /tmp/smol/hf --drafter $D --prompts builtin \
  --max-new-tokens 256 --output $W/eval-chat --no-progress
stage bench_spec 150 python3 bench/bench_spec_decode.py /tmp/smol/hf --drafter $D --prompts chat --num-prompts 16 \
  --max-new-tokens 256 --batch-slots 64 --batch-prompts 128 --out $OUT/spec_trained.json
for s in humaneval chat; do cp $W/eval-$s/report.json $OUT/report_$s.json 2>/dev/null; done
cp $D/config.json $OUT/drafter_config.json 2>/dev/null
grep -E "^===|tau|speedup|equals|greedy|batched|lossless|ms per" $LOG | tail -45
