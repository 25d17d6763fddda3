#!/usr/bin/env bash
# H200 session 3, call B (right after A): SmolLM2 from the two GGUF parts -> bf16 HF folder,
# then the fast speculative decoder's overheads with a random drafter (issue 15).
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/session3b.log; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >> $LOG 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -f /tmp/smol/part_aa ]; then echo "FRESH MACHINE: /tmp/smol/part_aa missing" | tee -a $LOG; exit 3; fi
if [ ! -f /tmp/smol/hf/model.safetensors ]; then
  cat /tmp/smol/part_aa .smol2/part_ab > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf | tee -a $LOG
  timeout 120 python3 bench/device/convert_smollm2.py /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol/hf >> $LOG 2>&1
fi
timeout 400 python3 bench/bench_spec_decode.py /tmp/smol/hf --random-drafter --prompts chat --num-prompts 8 \
  --max-new-tokens 128 --batch-slots 64 --batch-prompts 128 --out $OUT/spec_random.json >> $LOG 2>&1
echo "bench rc=$?" | tee -a $LOG
tail -30 $LOG
