#!/usr/bin/env bash
# Decoding speed, seen from the inside (random weights: time depends on shapes only):
#   generate   bench/profile_generate.py on the generate target's shape (SmolLM2-135M) at SLOTS
#              (default 1536) and at 256 slots, greedy, and at SLOTS with SAMPLED_SHARE (default
#              0.3, the recipe's --mix runs of 2026-12-03) of the slots sampling as user turns:
#              kernels and device ms per decode step, achieved HBM GB/s, the split attention /
#              matmuls / sampling / other / host gap; ~4 min
#   qwen3      the same on Qwen3-8B's shape at 256 slots against the H200's 4.8 TB/s: the key
#              generate.qwen3_8b.new_tok_per_s (steady decoding, every slot busy); ~4 min
#   prefill    prefill chunks as the engine runs them (profile_generate's --prefill-shapes: the recipe's
#              widths up to 2,048 tokens in 16,384-token chunks, one 256-token row, two chunks that pad
#              up to their bucket shapes) at SmolLM2's shape, each shape a captured step and eager
#              (--no-cuda-graphs): ms a chunk and the host's ms issuing it; ~2 min
#   draft      bench/draft_context_cost.py: the batch-1 draft step's ms per round at contexts of
#              256, 1K, 4K and 16K tokens, SmolLM2's 5-layer full-attention drafter as it is and
#              decoded with a 2,048-token window (--draft-window): eval.draft_ms_per_round_by_context; ~3 min
#     bash dev/device/decode_profile.sh            # all four; results in $OUT: gen_smollm2_<slots>[_sampled].json,
#                                                    # prefill_smollm2_135m_{graphs,eager}.json, gen_qwen3_8b_256.json,
#                                                    # draft_context_cost.json, decode_profile.log
#     PART=draft bash dev/device/decode_profile.sh # one part
# DRY=1: the plumbing on CPU with the tiny preset (~1 min; PY=.venv/bin/python in a checkout).
# A failed stage makes the exit status 1, after the summary.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/decode_profile.log; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PY=${PY:-python3}
PART=${PART:-all}
if [ "${DRY:-0}" = 1 ]; then
  SMOL=tiny; QWEN=tiny; SLOTS=4; CPU="--device cpu --threads 1"; GEN="--prompt-len 24 --warmup 2 --steps 3"
  DRAFT="--sliding-window 0 --draft-windows 0 64 --contexts 256 1024 4096 --iters 5"
  export OMP_NUM_THREADS=1
else
  SMOL=smollm2-135m; QWEN=qwen3-8b; SLOTS=${SLOTS:-1536}; CPU=""; GEN="--prompt-len ${PROMPT_LEN:-256} --warmup 8 --steps 20"
  DRAFT="--draft-windows 0 2048 --contexts 256 1024 4096 16384 --iters 50"
fi
source dev/device/lib.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >> $LOG 2>&1
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> $LOG 2>&1

if [ "$PART" = all ] || [ "$PART" = generate ]; then
  for n in $SLOTS 256; do
    stage gen_${SMOL}_$n 200 $PY bench/profile_generate.py preset:$SMOL --slots $n $GEN $CPU \
      --out $OUT/gen_${SMOL//-/_}_$n.json
  done
  stage gen_${SMOL}_${SLOTS}_sampled 200 $PY bench/profile_generate.py preset:$SMOL --slots $SLOTS $GEN $CPU \
    --sampled-share ${SAMPLED_SHARE:-0.3} --out $OUT/gen_${SMOL//-/_}_${SLOTS}_sampled.json
fi
if [ "$PART" = all ] || [ "$PART" = prefill ]; then
  if [ "${DRY:-0}" = 1 ]; then PREFILL="--prompt-len 24 --warmup 2 --steps 3 --prefill-shapes 4x24 1x24 3x20"
  else PREFILL="--prompt-len 2048 --warmup 2 --steps 3 --prefill-reps 5 --prefill-shapes 8x2048 16x1024 32x512 64x256 128x128 1x256 3x700 5x1500"
  fi
  for how in graphs eager; do
    flag=(); [ "$how" = eager ] && flag=(--no-cuda-graphs)
    stage prefill_${SMOL}_$how 200 $PY bench/profile_generate.py preset:$SMOL --slots $((SLOTS < 256 ? SLOTS : 256)) $PREFILL $CPU \
      "${flag[@]}" --out $OUT/prefill_${SMOL//-/_}_$how.json
  done
fi
if [ "$PART" = all ] || [ "$PART" = qwen3 ]; then
  stage gen_${QWEN}_256 300 $PY bench/profile_generate.py preset:$QWEN --slots 256 $GEN --peak-gbs 4800 $CPU \
    --out $OUT/gen_${QWEN//-/_}_256.json
fi
if [ "$PART" = all ] || [ "$PART" = draft ]; then
  stage draft_context_cost 240 $PY bench/draft_context_cost.py preset:$SMOL --layers 5 $DRAFT $CPU \
    --out $OUT/draft_context_cost.json
fi
grep -E "^===|^profile_generate|^new tok/s|^ms / step|^kernels|^share|^bytes|^HBM|^bound|^prefill|^draft window|rror|Traceback" $LOG \
  | cut -c1-220 | tail -70
stages_status
