#!/usr/bin/env bash
# The SmolLM2 recipe on a GPU machine (docs/recipe-smollm2.md), step 1 of 5: the prompt files
# (`dflash-train prompts` through scripts/smollm2_recipe_x2.sh, one shard per GPU; ~1-2 min on the
# machine's CPU), with the speculative engine's batch-1 profile and random-drafter speed on the idle
# GPU meanwhile (bench/profile_spec_round.py, bench/bench_spec_decode.py; ENGINE=0 skips it). The
# recipe's steps: recipe_prompts.sh, recipe_generate.sh, recipe_train.sh, recipe_resume.sh,
# recipe_eval.sh (recipe_full.sh and recipe_levers.sh build on them). One or two H200s, ~3 min:
#     ENGINE=0 bash dev/device/recipe_prompts.sh     # prompts in /tmp/recipe/prompts, log in $OUT/recipe_prompts.log
# Carried files, where the GPU host cannot download: .smol*/part_* (parts of the SmolLM2 GGUF,
# kept in /tmp/smol for lib.sh smol_hf), .whl/ (wheels installed into /tmp/site).
# RECIPE_FROM=.recipe: unpack conversations exported by an earlier recipe_generate.sh, so the next
# generation adds to them (cat .recipe/recipe.tar.xz.part_* | xz -d | tar -C /tmp/recipe -xf -).
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/recipe_prompts.log; W=/tmp/recipe; mkdir -p $OUT $W /tmp/smol
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
source dev/device/lib.sh
smol_keep
nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a $LOG
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >> $LOG 2>&1
export PYTHONPATH=/tmp/site:$PWD/src
# The GPU is idle while the prompts are built on the CPU: the engine's batch-1 profile (random
# SmolLM2-shaped weights) meanwhile, into its own log.
if [ "${ENGINE:-1}" = 1 ]; then
  ( LOG=$OUT/engine.log; PYTHONPATH=$PWD/src
    stage profile1 150 python3 bench/profile_spec_round.py preset:smollm2-135m --attention flex --out $OUT/profile1.json
    stage spec_random 150 python3 bench/bench_spec_decode.py preset:smollm2-135m --random-drafter --num-prompts 8 \
      --max-new-tokens 128 --batch-slots 64 --batch-prompts 128 --out $OUT/spec_random.json ) & engine=$!
fi
stage prompts 400 env WORK=$W NGPU=$NGPU STEPS=prompts bash scripts/smollm2_recipe_x2.sh
if [ -n "${RECIPE_FROM:-}" ]; then  # conversations exported by an earlier recipe_generate.sh
  mkdir -p $W/gen && cat $RECIPE_FROM/recipe.tar.xz.part_* | xz -d | tar -C $W -xf - && echo "unpacked $RECIPE_FROM into $W" | tee -a $LOG
  wc -l $W/gen/gen-*.jsonl | tee -a $LOG
fi
[ -n "${engine:-}" ] && wait $engine
cp $W/prompts/manifest.json $OUT/prompts_manifest.json 2>/dev/null
grep -E "^===|^source|^[a-z-]+ +[0-9,]+ |wrote|up to date|rror|Traceback" $LOG | tail -20
[ -f $OUT/engine.log ] && grep -E "^===|kernels,|ceiling|^batch|^speedup|^ms per|^lossless|rror|Traceback" $OUT/engine.log | cut -c1-150 | tail -30
stages_status
