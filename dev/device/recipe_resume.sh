#!/usr/bin/env bash
# The SmolLM2 recipe, step 4 (optional): resume recipe_train.sh's run for TRAIN_MINUTES more
# (default 8). On the same GPU host after recipe_train.sh; ~9 min:
#     TRAIN_MINUTES=8 bash dev/device/recipe_resume.sh     # results in $OUT: recipe_resume.log, metrics.jsonl
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/recipe_resume.log; W=/tmp/recipe; mkdir -p $OUT
source dev/device/lib.sh
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -d $W/train/checkpoints ]; then echo "FRESH MACHINE: no checkpoints in $W/train" | tee -a $LOG; exit 3; fi
TARGET=${TARGET:-/tmp/smol/hf} WORK=$W NGPU=$NGPU STEPS=train TRAIN_MINUTES=${TRAIN_MINUTES:-8} \
  timeout 560 bash scripts/smollm2_recipe_x2.sh >> $LOG 2>&1
echo "recipe rc=$?" | tee -a $LOG
cp $W/train/metrics.jsonl $OUT/metrics.jsonl 2>/dev/null
grep -E "^==|held-out @|eval @|resum|rc=|rror|Traceback" $LOG | grep -v "it/s\]" | tail -30
