#!/usr/bin/env bash
# H200 session 4, call D (right after C, the trained drafter in /tmp): the batch-1 speedup of a
# trained drafter on the engine (issue 15's 0.8 x tau goal, registry eval.spec_*), then
# `dflash-train eval` on HumanEval (164 x 256) and the held-out chat prompts.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/eval4.log; W=/tmp/smolrun; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
D=$W/train/final
if [ ! -f $D/model.safetensors ]; then echo "no trained drafter in $D" | tee -a $LOG; exit 3; fi
source bench/device/lib.sh
stage bench_spec 150 python3 bench/bench_spec_decode.py /tmp/smol/hf --drafter $D --prompts chat --num-prompts 16 \
  --max-new-tokens 256 --batch-slots 64 --batch-prompts 128 --out $OUT/spec_trained4.json
stage eval_humaneval 200 python3 -m dflash_train eval --target /tmp/smol/hf --drafter $D --prompts humaneval \
  --max-new-tokens 256 --output $W/eval-humaneval --no-progress
stage eval_chat 120 python3 -m dflash_train eval --target /tmp/smol/hf --drafter $D --prompts builtin \
  --max-new-tokens 256 --output $W/eval-chat --no-progress
stage profile64 120 python3 bench/profile_spec_round.py preset:smollm2-135m --slots 64 --attention dense \
  --out $OUT/profile64.json
for s in humaneval chat; do cp $W/eval-$s/report.json $OUT/report4_$s.json 2>/dev/null; done
grep -E "^===|tau|speedup|equals|^batch|lossless|ms per|kernels,|ceiling" $LOG | tail -40
