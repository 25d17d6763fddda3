#!/usr/bin/env bash
# H200 session 5, call A (nvidia-h200 or -x2; carry .smol1): part one of the SmolLM2 GGUF into
# /tmp/smol (the tree carries at most 64 MiB per call), and the prompt files of the issue-17
# recipe built on the machine's CPU (about 1-2 min), with the engine profile of issue 15 on the idle GPU
# meanwhile (ENGINE=0 skips it). Call B follows at once. ~3 min.
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/session5a.log; W=/tmp/recipe; mkdir -p $OUT $W /tmp/smol
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
source bench/device/lib.sh
cp .smol1/part_aa /tmp/smol/ && ls -la /tmp/smol >> $LOG
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $LOG
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >> $LOG 2>&1
export PYTHONPATH=/tmp/site:$PWD/src
# The GPU is idle while the prompts are built on the CPU: the engine's batch-1 profile (issue 15;
# random SmolLM2-shaped weights) meanwhile, into its own log.
if [ "${ENGINE:-1}" = 1 ]; then
  ( LOG=$OUT/engine.log; PYTHONPATH=$PWD/src
    stage profile1 150 python3 bench/profile_spec_round.py preset:smollm2-135m --attention flex --out $OUT/profile1.json
    stage spec_random 150 python3 bench/bench_spec_decode.py preset:smollm2-135m --random-drafter --num-prompts 8 \
      --max-new-tokens 128 --batch-slots 64 --batch-prompts 128 --out $OUT/spec_random.json ) & engine=$!
fi
stage prompts 400 env WORK=$W NGPU=$NGPU STEPS=prompts bash scripts/smollm2_recipe_x2.sh
[ -n "${engine:-}" ] && wait $engine
cp $W/prompts/manifest.json $OUT/prompts_manifest.json 2>/dev/null
grep -E "^===|^source|^[a-z-]+ +[0-9,]+ |wrote|up to date|rror|Traceback" $LOG | tail -20
[ -f $OUT/engine.log ] && grep -E "^===|kernels,|ceiling|^batch|^speedup|^ms per|^lossless|rror|Traceback" $OUT/engine.log | cut -c1-150 | tail -30
