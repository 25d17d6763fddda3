#!/usr/bin/env bash
# The training step's memory-bound kernels, each alone at the qwen3-8b shape (one H200, ~8 min
# cold for all three; PART picks one):
#   PART=ce         the LM head's per-chunk cross-entropy math (bench/ce_chunk_kernels.py, 4096 x
#                   151,936 bf16): row_stats' Triton pass + the compiled gradient against Inductor's
#                   fused chunk function (INDUCTOR: its option sets, default "" only), the kernel's
#                   block/warp configs, the per-lane candidate; then row_stats' GPU test if pytest
#                   is installed (~3 min)
#   PART=optimizer  the optimizer step and the gradients' global norm (bench/optimizer_kernels.py:
#                   fused / compiled AdamW, a compiled norm as the candidate) (~2 min)
#   PART=flex       one drafter layer's FlexAttention forward + backward (bench/flex_kernel_options.py):
#                   the partial tiles' element-wise rule `ranges` (the code's), `rule` (the spec's
#                   make_mask_mod) and `noop` (no masking: the bound), at 128- and 64-token tiles (~4 min)
#   PART=all        the three (default)
#     bash dev/device/step_kernels.sh            # results in $OUT: ce_chunk_kernels.json,
#                                                  # optimizer_kernels.json, flex_mask.json, step_kernels.log
# DRY=1: the plumbing on CPU (tiny shapes).
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/step_kernels.log; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
source dev/device/lib.sh
if [ "${DRY:-0}" = 1 ]; then T=(--tiny --device cpu --iters 2); export OMP_NUM_THREADS=1; else T=(); fi
PART=${PART:-all}
read -ra IND <<< "${INDUCTOR:-}"; [ ${#IND[@]} = 0 ] && IND=("")  # "" = Inductor's default options
if [ "$PART" = all ] || [ "$PART" = ce ]; then
  stage ce_chunk ${CE_LIMIT:-300} python3 bench/ce_chunk_kernels.py --iters 20 "${T[@]}" --inductor "${IND[@]}" \
    --out $OUT/ce_chunk_kernels.json
  if [ "${DRY:-0}" != 1 ] && python3 -c "import pytest" 2>/dev/null; then
    stage row_stats_gpu_test 120 python3 -m pytest -q -p no:cacheprovider tests/drafter/test_row_stats.py
  fi
fi
if [ "$PART" = all ] || [ "$PART" = optimizer ]; then
  stage optimizer ${OPT_LIMIT:-180} python3 bench/optimizer_kernels.py --iters 20 "${T[@]}" --out $OUT/optimizer_kernels.json
fi
if [ "$PART" = all ] || [ "$PART" = flex ]; then
  stage flex_mask ${FLEX_LIMIT:-240} python3 bench/flex_kernel_options.py --iters 30 "${T[@]}" --rows default fwd64x64w4 \
    --mask-mods ranges rule noop --tiles 128 64 --out $OUT/flex_mask.json
fi
grep -E "^===| ms|rror|Traceback|GB|passed|failed|skipped" $LOG | cut -c1-200 | tail -60
stages_status
