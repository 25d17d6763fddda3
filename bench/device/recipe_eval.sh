#!/usr/bin/env bash
# H200 session 5, call E (right after D): the measured eval of the trained drafter on both GPUs:
# HumanEval 164 x 256, the held-out chat prompts, 32 held-out and 32 training prompts of every
# source (held-out vs train tau: memorisation check), plus the batch-1 speedup. ~7 min.
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/session5e.log; W=/tmp/recipe; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
D=$W/train/final
if [ ! -f $D/model.safetensors ]; then echo "no trained drafter in $D" | tee -a $LOG; exit 3; fi
TARGET=/tmp/smol/hf WORK=$W NGPU=$NGPU STEPS=eval EVAL_SOURCE_PROMPTS=${EVAL_SOURCE_PROMPTS:-32} timeout 420 bash scripts/smollm2_recipe_x2.sh >> $LOG 2>&1
echo "eval rc=$?" | tee -a $LOG
timeout 120 python3 bench/bench_spec_decode.py /tmp/smol/hf --drafter $D --prompts chat --num-prompts 16 \
  --max-new-tokens 256 --batch-slots 64 --batch-prompts 128 --out $OUT/spec_trained5.json >> $LOG 2>&1
for r in $W/eval-*/report.json; do n=$(basename $(dirname $r)); cp $r $OUT/report5_$n.json; done
cp $W/eval-summary.json $OUT/ 2>/dev/null
grep -E "^==|tau|speedup|rc=|rror|Traceback" $LOG | tail -40
