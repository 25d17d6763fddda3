#!/usr/bin/env bash
# H200 session 5, call D (right after C): resume the training to the config's 15 minutes in all
# (TRAIN_MINUTES counts from the resume: default 8), then the eval of call E can start. ~9 min.
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/session5d.log; W=/tmp/recipe; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -d $W/train/checkpoints ]; then echo "FRESH MACHINE: no checkpoints in $W/train" | tee -a $LOG; exit 3; fi
TARGET=/tmp/smol/hf WORK=$W NGPU=$NGPU STEPS=train TRAIN_MINUTES=${TRAIN_MINUTES:-8} \
  timeout 560 bash scripts/smollm2_recipe_x2.sh >> $LOG 2>&1
echo "recipe rc=$?" | tee -a $LOG
cp $W/train/metrics.jsonl $OUT/metrics5.jsonl 2>/dev/null
grep -E "^==|held-out @|eval @|resum|rc=|rror|Traceback" $LOG | grep -v "it/s\]" | tail -30
