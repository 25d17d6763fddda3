#!/usr/bin/env bash
# The recommended bf16 training step (the `autotune` row of drafter_step.sh), this tree against a
# previous one, on one machine: runs new, old, new (~15 min cold on one H200: each row compiles and
# autotunes ~2 min; ROW_LIMIT 270 s a row). The previous tree is carried as an untracked copy:
#     mkdir ab_base && git archive <previous commit> src | tar -x -C ab_base
#     bash dev/device/step_ab.sh        # results in $OUT: new_autotune.json, old_autotune.json,
#                                         # new2_autotune.json, drafter_step.log, kernels.tgz
# ORDER="new1_ old1_ new2_ old2_": the rows and their order (a tag starting with old_ or oldN_ runs
# ab_base; default "new_ old_ new2_"). PRESET=dense-27b for the other shape. DRY=1: the plumbing on CPU.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/step_ab.log; mkdir -p $OUT
source dev/device/lib.sh
if [ ! -d ab_base/src ]; then
  echo "no ab_base/src: the A/B needs the previous tree (see the header)" | tee -a $LOG; exit 2
fi
for tag in ${ORDER:-new_ old_ new2_}; do
  src=$PWD/src; case $tag in old*) src=$PWD/ab_base/src ;; esac
  SRC=$src ROWS=autotune TAG=$tag ROW_LIMIT=${ROW_LIMIT:-270} bash dev/device/drafter_step.sh > /dev/null
  grep -E "^=== $tag" $OUT/drafter_step.log | tail -1
done
grep -E "^=== |tokens/s|time/step|rror" $OUT/drafter_step.log | cut -c1-200
# the kernel tables in one archive (fewer files to bring back)
(cd $OUT && tar czf kernels.tgz *.kernels.txt && rm -f *.kernels.txt)
