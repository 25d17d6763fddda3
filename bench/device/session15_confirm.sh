#!/usr/bin/env bash
# H200 (issue 18): session 14's code on another machine, in one call (~6 min cold):
#   1. the chunk statistics alone (PART=kernel of session14_step.sh: row_stats' configs and the
#      `lanes` candidate of bench/ce_chunk_kernels.py, the kernel's GPU test);
#   2. the recommended step three times (session10_drafter.sh ROWS="autotune autotune autotune").
# TAG= names this machine's files (default x_). DRY=1: the plumbing on CPU.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
PART=kernel bash bench/device/session14_step.sh
ROWS="autotune autotune autotune" TAG=${TAG:-x_} ROW_LIMIT=${ROW_LIMIT:-270} bash bench/device/session10_drafter.sh \
  | grep -E "^=== |tokens/s|time/step|rror" | cut -c1-200
# at most 8 files come back: the kernel tables in one archive
(cd $OUT && tar czf ${TAG:-x_}kernels.tgz *.kernels.txt && rm -f *.kernels.txt)
