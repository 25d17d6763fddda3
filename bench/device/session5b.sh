#!/usr/bin/env bash
# H200 session 5, call B (right after A; carry .smol2 and .whl): join + convert
# the GGUF, then generation on both GPUs (one process per GPU, disjoint prompt shards plus
# self-instructed chats), GEN_LIMIT s (default 420); SLOTS (default 256) sequences per GPU.
# Resumable: call B2 (the same script) adds more if the budget allows; so does a later session
# that unpacked an earlier export (RECIPE_FROM in call A): finished rows are skipped. ~8.5 min.
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/session5b.log; W=/tmp/recipe; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >> $LOG 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -f /tmp/smol/part_aa ] || [ ! -f $W/prompts/manifest.json ]; then echo "FRESH MACHINE: run call A first" | tee -a $LOG; exit 3; fi
if [ ! -f /tmp/smol/hf/model.safetensors ]; then
  cat /tmp/smol/part_aa .smol2/part_ab > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 120 python3 bench/device/convert_smollm2.py /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol/hf >> $LOG 2>&1
fi
echo "=== generate $(date +%T)" | tee -a $LOG
TARGET=/tmp/smol/hf WORK=$W NGPU=$NGPU STEPS=generate GEN_LIMIT=${GEN_LIMIT:-420} MAX_NEW=${MAX_NEW:-512} \
  N_SYNTH=${N_SYNTH:-30000} bash scripts/smollm2_recipe_x2.sh >> $LOG 2>&1
echo "=== generate rc=$? $(date +%T)" | tee -a $LOG
wc -l $W/gen/gen-*.jsonl | tee -a $LOG
for f in $W/gen/gen-*.log; do tail -c 20000 $f > $OUT/$(basename $f); done  # the summary: written, new tok/s
grep -E "^===|written|new_tokens|stopped|rror|Traceback" $LOG $W/gen/gen-*.log | tail -20
# The generated conversations come back (xz, 15 MB parts under $OUT/recipe/): a later session
# carries them (git-ignored .recipe/, RECIPE_FROM=.recipe in call A), and its generation adds to
# them (the prompt files are rebuilt identically on the same machine image: finished rows skip).
if [ "${EXPORT:-1}" = 1 ]; then
  mkdir -p $OUT/recipe
  (cd $W && tar -cf - gen/gen-*.jsonl) | xz -T0 -6 | split -b 15000000 - $OUT/recipe/recipe.tar.xz.part_
  ls -la $OUT/recipe | tee -a $LOG
fi
