#!/usr/bin/env bash
# H200 session 5, call A (nvidia-h200-x2; carry .smol1): part one of the SmolLM2 GGUF into
# /tmp/smol (the tree carries at most 64 MiB per call), and the prompt files of the issue-17
# recipe built on the machine's CPU (about 1-2 min). Call B follows at once. ~2 min.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/session5a.log; W=/tmp/x2; mkdir -p $OUT $W /tmp/smol
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a $LOG
  timeout --signal=TERM --kill-after=10 $limit "$@" >> $LOG 2>&1
  echo "=== $name rc=$? $(date +%T)" | tee -a $LOG
}
cp .smol1/part_aa /tmp/smol/ && ls -la /tmp/smol >> $LOG
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $LOG
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >> $LOG 2>&1
export PYTHONPATH=/tmp/site:$PWD/src
stage prompts 400 env WORK=$W NGPU=2 STEPS=prompts bash scripts/smollm2_recipe_x2.sh
cp $W/prompts/manifest.json $OUT/prompts_manifest.json 2>/dev/null
grep -E "^===|^source|^[a-z-]+ +[0-9,]+ |wrote|up to date|rror|Traceback" $LOG | tail -20
