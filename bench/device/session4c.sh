#!/usr/bin/env bash
# H200 session 4, call C (right after B, which left part one of the GGUF in /tmp/smol): the
# SmolLM2 recipe on the new engine (the in-training held-out probe runs it): join + convert,
# 140 s of self-instructed generation, prepare, 4 min of training. Call D evaluates.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/recipe4.log; W=/tmp/smolrun; mkdir -p $OUT $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >> $LOG 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -f /tmp/smol/part_aa ]; then echo "FRESH MACHINE: /tmp/smol/part_aa missing" | tee -a $LOG; exit 3; fi
if [ ! -f /tmp/smol/hf/model.safetensors ]; then
  cat /tmp/smol/part_aa .smol2/part_ab > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf >> $LOG
  timeout 120 python3 bench/device/convert_smollm2.py /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol/hf >> $LOG 2>&1
fi
TARGET=/tmp/smol/hf WORK=$W N_SYNTH=100000 MAX_NEW=384 SLOTS=256 GEN_LIMIT=${GEN_LIMIT:-140} \
  SKIP_EVAL=1 TRAIN_ARGS="--run.max_minutes ${TRAIN_MINUTES:-4} --run.eval_every ${EVAL_EVERY:-300} --run.log_every 100" \
  timeout 540 bash scripts/smollm2_recipe.sh >> $LOG 2>&1
echo "recipe rc=$?" | tee -a $LOG
cp $W/train/metrics.jsonl $OUT/metrics4.jsonl 2>/dev/null
grep -E "^==|held-out @|eval @|conversations|rc=|rror|Traceback" $LOG | grep -v "it/s\]" | tail -30
