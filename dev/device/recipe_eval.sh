#!/usr/bin/env bash
# The SmolLM2 recipe, step 5: the measured eval of the trained drafter (/tmp/recipe/train/final) on
# every GPU: `dflash-train eval` on HumanEval 164 x 256, the held-out chat prompts, and
# EVAL_SOURCE_PROMPTS (default 32) held-out and training prompts of every source (held-out against
# training tau: the memorisation check; scripts/recipe_eval_summary.py), then the batch-1 and batched
# speed (bench/bench_spec_decode.py, chat 16 x 256; registry eval.*, quality.smollm2.*). ~7 min:
#     EVAL_SOURCE_PROMPTS=16 bash dev/device/recipe_eval.sh
# Results in $OUT: recipe_eval.log, report-<set>.json, eval-summary.json, spec-trained.json.
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/recipe_eval.log; W=/tmp/recipe; mkdir -p $OUT
source dev/device/lib.sh
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
TARGET=${TARGET:-/tmp/smol/hf}  # a Hugging Face folder; default: the built-in SmolLM2 converted by lib.sh smol_hf
D=$W/train/final
if [ ! -f $D/model.safetensors ]; then echo "no trained drafter in $D" | tee -a $LOG; exit 3; fi
TARGET=$TARGET WORK=$W NGPU=$NGPU STEPS=eval EVAL_SOURCE_PROMPTS=${EVAL_SOURCE_PROMPTS:-32} timeout 420 bash scripts/smollm2_recipe_x2.sh >> $LOG 2>&1
echo "eval rc=$?" | tee -a $LOG
timeout 120 python3 bench/bench_spec_decode.py $TARGET --drafter $D --prompts chat --num-prompts 16 \
  --max-new-tokens 256 --batch-slots 64 --batch-prompts 128 --out $OUT/spec-trained.json >> $LOG 2>&1
for r in $W/eval-*/report.json; do n=$(basename $(dirname $r)); cp $r $OUT/report-${n#eval-}.json; done
cp $W/eval-summary.json $OUT/ 2>/dev/null
grep -E "^==|tau|speedup|rc=|rror|Traceback" $LOG | tail -40
