#!/usr/bin/env bash
# H200, next session (issue 15): the engine after the batch-1 graphed prefill and the k/v writes
# fused into the compiled projections (landed after session 4's measurements). SmolLM2 shapes,
# random weights: kernels per step at batch 1 (flex) and 64 slots (dense), and the batch-1 /
# batched bench (a random drafter: tau ~ 1, so speedup = per-round overhead incl. prefill).
# ~2.5 min. Carries nothing; copies part one of the SmolLM2 GGUF to /tmp/smol if .smol1 came
# along (so the next call can convert it). Results: $OUT/session5_engine.log, $OUT/*.json.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/session5_engine.log; mkdir -p $OUT
if [ -d .smol1 ]; then mkdir -p /tmp/smol && cp .smol1/part_aa /tmp/smol/; fi
source bench/device/lib.sh
T=preset:smollm2-135m
stage profile1 120 python3 bench/profile_spec_round.py $T --attention flex --out $OUT/profile1.json
stage profile64 120 python3 bench/profile_spec_round.py $T --slots 64 --attention dense --out $OUT/profile64.json
stage spec 150 python3 bench/bench_spec_decode.py $T --random-drafter --num-prompts 8 \
  --max-new-tokens 128 --batch-slots 64 --batch-prompts 128 --out $OUT/spec_random.json
grep -E "^===|kernels,|ceiling|^batch|^speedup|^ms per|^lossless|rror|Traceback" $LOG | cut -c1-150 | tail -40
