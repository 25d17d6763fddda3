#!/usr/bin/env bash
# The whole test suite on a GPU machine (its own torch and Triton, not the CPU wheel CI uses), so
# the tests that skip on a CPU run and CPU-only assumptions show up. One H200, ~6-9 min:
#     bash bench/device/gpu_suite.sh          # results in $OUT/gpu_suite.log
# DRY=1: one test file on CPU.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/gpu_suite.log; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
source bench/device/lib.sh
python3 -c "import torch, triton, transformers, numpy; print('versions torch', torch.__version__, 'triton',
  triton.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)" | tee -a $LOG
if [ "${DRY:-0}" = 1 ]; then TESTS=(tests/drafter/test_row_stats.py); else TESTS=(tests); fi
stage suite ${SUITE_LIMIT:-540} python3 -m pytest -q -p no:cacheprovider -rfEs --durations=15 "${TESTS[@]}"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" $LOG | cut -c1-300 | tail -60
