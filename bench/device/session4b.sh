#!/usr/bin/env bash
# H200 session 4, call B (issue 15): call A again after the flat cache writes (no layout copy
# per K/V write), SmolLM2-135M-shaped random weights: kernels per step, batch-1 rounds with
# flex attention, and the batched engine (dense, the auto choice at 64 slots). Leaves part one
# of the SmolLM2 GGUF in /tmp/smol for call C. Results: $OUT/session4b.log, $OUT/*.json.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/session4b.log; mkdir -p $OUT
if [ -d .smol1 ]; then mkdir -p /tmp/smol && cp .smol1/part_aa /tmp/smol/; fi
source bench/device/lib.sh
T=preset:smollm2-135m
stage profile 150 python3 bench/profile_spec_round.py $T --attention flex --out $OUT/profile_b.json
stage spec_auto 150 python3 bench/bench_spec_decode.py $T --random-drafter --num-prompts 8 \
  --max-new-tokens 128 --batch-slots 64 --batch-prompts 128 --out $OUT/spec_auto.json
grep -E "^===|kernels,|ceiling|^batch|^speedup|^ms per|^lossless|rror|Traceback" $LOG | cut -c1-150 | tail -40
