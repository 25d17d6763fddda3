#!/usr/bin/env bash
# H200 session 3, call F (machine still warm after D): train again on D's data with the fixed
# estimate (every anchor of a packed row), evaluating every 150 steps.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/recipe2.log; W=/tmp/smolrun; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -f $W/data/manifest.json ]; then echo "FRESH MACHINE: no data in $W" | tee -a $LOG; exit 3; fi
rm -rf $W/train
timeout 400 python3 -m dflash_train train --config configs/smollm2-135m.yaml --target.path /tmp/smol/hf \
  --data.path $W/data --run.output_dir $W/train --run.progress false --run.max_minutes 4 --run.eval_every 150 \
  --run.log_every 150 >> $LOG 2>&1
echo "train rc=$?" | tee -a $LOG
cp $W/train/metrics.jsonl $OUT/metrics2.jsonl 2>/dev/null
grep -E "held-out @|eval @|rc=|rror|Traceback" $LOG | tail -30
