#!/usr/bin/env bash
# The SmolLM2 recipe, step 3: the HumanEval guard on the generated user turns, prepare (train and
# held-out datasets), then training on every GPU (torchrun, colocated) for TRAIN_MINUTES (default 7;
# the config's run.fit_schedule sizes the LR schedule to that box). After recipe_generate.sh on the
# same machine; ~9 min:
#     TRAIN_MINUTES=7.5 TRAIN_ARGS="--run.max_steps 1700" bash dev/device/recipe_train.sh
# A run continued by recipe_resume.sh must size its schedule itself: TRAIN_ARGS="--run.fit_schedule
# false --run.max_steps N". Results in $OUT: recipe_train.log, metrics.jsonl.
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/recipe_train.log; W=/tmp/recipe; mkdir -p $OUT
source dev/device/lib.sh
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
TARGET=${TARGET:-/tmp/smol/hf}  # a Hugging Face folder; default: the built-in SmolLM2 converted by lib.sh smol_hf
if [ ! -f $W/gen/gen-0.jsonl ]; then echo "FRESH MACHINE: run recipe_prompts.sh and recipe_generate.sh first" | tee -a $LOG; exit 3; fi
MIN=${TRAIN_MINUTES:-7}  # the training's time box; the call's limit leaves room for prepare and the final eval
TARGET=$TARGET WORK=$W NGPU=$NGPU STEPS="prepare train" TRAIN_MINUTES=$MIN \
  timeout $(python3 -c "print(int($MIN * 60 + 100))") bash scripts/smollm2_recipe_x2.sh >> $LOG 2>&1
echo "recipe rc=$?" | tee -a $LOG
cp $W/train/metrics.jsonl $OUT/metrics.jsonl 2>/dev/null
grep -E "^==|^wrote|^read|eval split|held-out @|eval @|no near-duplicate|rc=|rror|Traceback" $LOG | grep -v "it/s\]" | tail -30
