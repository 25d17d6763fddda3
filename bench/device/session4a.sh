#!/usr/bin/env bash
# H200 session 4, call A (issue 15, the 0.8 x tau goal): where a speculative round's time goes,
# and dense vs flex cache attention, on a SmolLM2-135M-shaped target with random weights
# (per-round times depend on shapes only; a random drafter gives tau ~ 1, so the batch-1
# speedup is the per-round overhead itself). Also leaves part one of the SmolLM2 GGUF in
# /tmp/smol for call B. Results: $OUT/session4a.log, $OUT/profile.json, $OUT/spec_{dense,flex}.json.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/session4a.log; mkdir -p $OUT
if [ -d .smol1 ]; then mkdir -p /tmp/smol && cp .smol1/part_aa /tmp/smol/; fi
source bench/device/lib.sh
T=preset:smollm2-135m
stage profile 200 python3 bench/profile_spec_round.py $T --attention dense flex --out $OUT/profile.json
for a in flex dense; do
  stage spec_$a 150 python3 bench/bench_spec_decode.py $T --random-drafter --attention $a --num-prompts 8 \
    --max-new-tokens 128 --batch-slots 64 --batch-prompts 128 --out $OUT/spec_$a.json
done
grep -E "^===|kernels,|ceiling|top kernels|^    \(|^batch|^speedup|^ms per|^lossless|rror|Traceback" $LOG | cut -c1-150 | tail -90
