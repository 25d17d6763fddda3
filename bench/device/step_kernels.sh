#!/usr/bin/env bash
# H200 (issue 18): two memory-bound passes of the training step, alone (~4 min cold):
#   1. the LM head's per-chunk cross-entropy (bench/ce_chunk_kernels.py): compiled as today
#      against Inductor's coordinate-descent tuning and pointwise autotuning;
#   2. the optimizer step and the gradients' global norm (bench/optimizer_kernels.py), with
#      a compiled norm as the candidate.
# DRY=1: the plumbing on CPU (tiny shapes).
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/session14_kernels.log; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
source bench/device/lib.sh
if [ "${DRY:-0}" = 1 ]; then T=(--tiny --device cpu --iters 2); export OMP_NUM_THREADS=1; else T=(--iters 20); fi
(cd bench && stage ce_chunk ${CE_LIMIT:-300} python3 ce_chunk_kernels.py "${T[@]}" --out $OUT/ce_chunk_kernels.json)
(cd bench && stage optimizer ${OPT_LIMIT:-180} python3 optimizer_kernels.py "${T[@]}" --out $OUT/optimizer_kernels.json)
grep -E "ms|rror|Traceback|GB" $LOG | grep -v "^===" | cut -c1-200
