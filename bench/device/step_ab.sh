#!/usr/bin/env bash
# H200 (issue 18): the LM head's chunk statistics as one Triton pass (drafter/row_stats.py),
# in one call (~6 min cold):
#   1. the chunk math alone (bench/ce_chunk_kernels.py): Inductor's fused chunk function (the
#      code before) against what the loss runs now, the kernel's block/warp configs, torch argmax;
#   2. row_stats' GPU test (the Triton kernel against the torch blocks), if pytest is there;
#   3. the whole recommended step, this tree against the previous one (session10_drafter.sh
#      rows `autotune`: new, old, new), when the previous tree is carried as an untracked copy:
#        mkdir ab_base && git archive <previous commit> src | tar -x -C ab_base
# PART=kernel or PART=step runs one half. DRY=1: the plumbing on CPU.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/session14_step.log; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
source bench/device/lib.sh
if [ "${DRY:-0}" = 1 ]; then K=(--tiny --device cpu --iters 2); export OMP_NUM_THREADS=1; else K=(--iters 20); fi
if [ "${PART:-all}" != step ]; then
  (cd bench && stage ce_chunk ${KERNEL_LIMIT:-150} python3 ce_chunk_kernels.py "${K[@]}" --inductor "" \
    --out $OUT/ce_chunk_kernels.json)
  grep -E "ms |rror|Traceback" $LOG | cut -c1-200
  if python3 -c "import pytest" 2>/dev/null; then
    stage row_stats_gpu_test 120 python3 -m pytest -q -p no:cacheprovider tests/drafter/test_row_stats.py
    grep -E "passed|failed|skipped|Error" $LOG | tail -3
  fi
fi
if [ "${PART:-all}" != kernel ]; then
  if [ -d ab_base/src ]; then
    for tag in new_ old_ new2_; do
      src=$PWD/src; [ $tag = old_ ] && src=$PWD/ab_base/src
      SRC=$src ROWS=autotune TAG=$tag ROW_LIMIT=${ROW_LIMIT:-270} bash bench/device/session10_drafter.sh > /dev/null
      grep -E "^=== $tag" $OUT/session10_drafter.log | tail -1
    done
    grep -E "^=== |tokens/s|time/step|rror" $OUT/session10_drafter.log | cut -c1-200
    # at most 8 files come back: the kernel tables in one archive
    (cd $OUT && tar czf kernels.tgz *.kernels.txt && rm -f *.kernels.txt)
  else
    echo "no ab_base/src: the step A/B needs the previous tree (see the header)" | tee -a $LOG
  fi
fi
