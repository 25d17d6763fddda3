#!/usr/bin/env bash
# H200 session 3, call G (warm after E): resume F's run for 6 more minutes (toward its 2,100
# planned steps), evaluating every 150 steps: the estimate vs measurement at higher tau.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/recipe3.log; W=/tmp/smolrun; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -d $W/train/checkpoints ]; then echo "FRESH MACHINE: no run in $W" | tee -a $LOG; exit 3; fi
timeout 420 python3 -m dflash_train train --config configs/smollm2-135m.yaml --target.path /tmp/smol/hf \
  --data.path $W/data --run.output_dir $W/train --run.progress false --run.max_minutes 6 --run.eval_every 150 \
  --run.log_every 150 --resume >> $LOG 2>&1
echo "train rc=$?" | tee -a $LOG
cp $W/train/metrics.jsonl $OUT/metrics3.jsonl 2>/dev/null
grep -E "held-out @|resumed|rc=|rror|Traceback" $LOG | tail -30
