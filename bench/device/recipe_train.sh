#!/usr/bin/env bash
# H200 session 5, call C (right after B): HumanEval guard on the generated user
# turns, prepare (train + held-out datasets), then training on both GPUs (torchrun, colocated)
# for TRAIN_MINUTES (default 7; the config's run.fit_schedule sizes the LR schedule to that box).
# Call D can resume it for more minutes only when C did not fit the schedule to its own box:
# TRAIN_ARGS="--run.fit_schedule false --run.max_steps N" for a C + D chain. ~9 min.
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/session5c.log; W=/tmp/recipe; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -f /tmp/smol/hf/model.safetensors ] || [ ! -f $W/gen/gen-0.jsonl ]; then echo "FRESH MACHINE: run calls A, B first" | tee -a $LOG; exit 3; fi
MIN=${TRAIN_MINUTES:-7}  # the training's time box; the call's limit leaves room for prepare and the final eval
TARGET=/tmp/smol/hf WORK=$W NGPU=$NGPU STEPS="prepare train" TRAIN_MINUTES=$MIN \
  timeout $(python3 -c "print(int($MIN * 60 + 100))") bash scripts/smollm2_recipe_x2.sh >> $LOG 2>&1
echo "recipe rc=$?" | tee -a $LOG
cp $W/train/metrics.jsonl $OUT/metrics5.jsonl 2>/dev/null
grep -E "^==|^wrote|^read|eval split|held-out @|eval @|no near-duplicate|rc=|rror|Traceback" $LOG | grep -v "it/s\]" | tail -30
