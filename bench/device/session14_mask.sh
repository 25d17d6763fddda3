#!/usr/bin/env bash
# H200 (issue 18): the partial-tile mask of session 13 (drafter/masks.py range_mask_mod), measured
# in one call (~8 min on a cold machine):
#   1. the drafter's FlexAttention alone (bench/flex_kernel_options.py): the tiles' element-wise
#      rule `ranges` (now) against `rule` (before) and `noop` (the bound), at 128- and 64-token tiles;
#   2. the whole recommended step, the previous tree against this one (session10_drafter.sh rows
#      `autotune`), when the previous tree is carried as an untracked copy in ab_base/:
#        mkdir ab_base && git archive 77d47c5 src | tar -x -C ab_base
# PART=kernel or PART=step runs one half. DRY=1: the plumbing on CPU (tiny shapes, forward only).
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/session14_mask.log; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PY=${PY:-python3}
source bench/device/lib.sh
if [ "${DRY:-0}" = 1 ]; then KERNEL=(--tiny --device cpu --iters 2); export OMP_NUM_THREADS=1; else KERNEL=(--iters 30); fi
if [ "${PART:-all}" != step ]; then
  (cd bench && stage flex_mask ${KERNEL_LIMIT:-240} $PY flex_kernel_options.py "${KERNEL[@]}" --rows default fwd64x64w4 \
    --mask-mods ranges rule noop --tiles 128 64 --out $OUT/flex_mask.json)
  sed -n '/^options/,$p' $LOG
fi
if [ "${PART:-all}" != kernel ]; then
  if [ -d ab_base/src ]; then
    SRC=$PWD/ab_base/src ROWS=autotune TAG=old_ ROW_LIMIT=${ROW_LIMIT:-270} bash bench/device/session10_drafter.sh
    ROWS=autotune TAG=new_ ROW_LIMIT=${ROW_LIMIT:-270} bash bench/device/session10_drafter.sh
  else
    echo "no ab_base/src: the step A/B needs the previous tree (see the header)" | tee -a $LOG
  fi
fi
