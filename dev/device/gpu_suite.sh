#!/usr/bin/env bash
# The whole test suite on a GPU machine (its own torch and Triton, not the CPU wheel CI uses), so
# the tests that skip on a CPU run and CPU-only assumptions show up. In one process it does not
# fit one call on one H200 (682 of ~1,100 tests in 450 s: the host runs them ~1.5x slower than
# the 2-core CI machine); in four processes it should (WORKERS, below), or in two shards:
#     SHARD=1/2 bash dev/device/gpu_suite.sh; SHARD=2/2 bash dev/device/gpu_suite.sh
# Results in $OUT/gpu_suite.log: every test's outcome as it ends (-v), the 25 slowest, and a
# traceback of every thread of pytest should one test run past FAULT_S seconds (a hang says where);
# $OUT/gpu_suite_tests.log: each test's seconds and outcome as it ends, with a failure's traceback
# (tests/conftest.py, DFLASH_TEST_LOG), complete up to the last test even when a call is cut off.
# SHARD=i/n takes every n-th test file from the i-th (sorted paths); SHARD=1/1 (default) all.
# DRY=1: one test file on CPU. ONLY="tests/a.py::test_x tests/b.py": just those, PYTEST_EXTRA
# added to pytest's options (e.g. "-W error::UserWarning", to make a fallback's warning fail).
# WORKERS=N: N pytest processes side by side, tests handed out as workers free up (DIST, default
# worksteal; DIST=loadfile keeps each file on one worker) (pytest-xdist: the lent
# H200s have it; elsewhere carry .whl/pytest_xdist-*.whl and .whl/execnet-*.whl, from
# dev/fetch_wheels.sh);
# THREADS=N: each process's CPU threads (OMP_NUM_THREADS; torch's default is every core).
#     WORKERS=4 THREADS=4 bash dev/device/gpu_suite.sh     # the whole suite in one call
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/gpu_suite.log; mkdir -p $OUT
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
source dev/device/lib.sh
python3 -c "import os, torch, triton, transformers, numpy; print('versions torch', torch.__version__, 'triton',
  triton.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__, 'cores', os.cpu_count())" | tee -a $LOG
SHARD=${SHARD:-1/1}; i=${SHARD%/*}; n=${SHARD#*/}
if [ -n "${ONLY:-}" ]; then  # ONLY="path::test ...": just these (with PYTEST_EXTRA, e.g. "-W error::UserWarning")
  read -r -a TESTS <<< "$ONLY"
elif [ "${DRY:-0}" = 1 ]; then
  TESTS=(tests/drafter/test_row_stats.py)
else
  mapfile -t TESTS < <(find tests -name 'test_*.py' | sort | awk -v i="$i" -v n="$n" '(NR - i) % n == 0')
fi
echo "shard $SHARD: ${#TESTS[@]} test files" | tee -a $LOG
XDIST=()
if [ "${WORKERS:-0}" -gt 0 ]; then  # the lent H200s' image has pytest-xdist; elsewhere carry its wheels
  if ! python3 -c "import xdist" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/pytest_xdist-*.whl \
      .whl/execnet-*.whl >> $LOG 2>&1 || { echo "WORKERS needs pytest-xdist or its carried wheels (.whl)" | tee -a $LOG; exit 3; }
    export PYTHONPATH=/tmp/site:$PYTHONPATH
  fi
  # worksteal, not loadfile: tests/pipeline/test_pipeline.py alone took 401 s of one worker on an
  # H200 host (its torchrun jobs), the whole suite's ~920 s of tests spread over four workers ~230 s
  XDIST=(-n "$WORKERS" --dist "${DIST:-worksteal}")
fi
[ -n "${THREADS:-}" ] && export OMP_NUM_THREADS=$THREADS
echo "workers ${WORKERS:-0}, threads ${THREADS:-default}" | tee -a $LOG
export DFLASH_TEST_LOG=$OUT/gpu_suite_tests.log  # each test's seconds as it ends, failures' tracebacks
stage "suite $SHARD" ${SUITE_LIMIT:-540} python3 -m pytest -v -p no:cacheprovider -rfEs --durations=25 \
  -o faulthandler_timeout=${FAULT_S:-240} ${PYTEST_EXTRA:-} "${XDIST[@]}" "${TESTS[@]}"
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|Timeout|Thread 0x" $LOG | cut -c1-300 | tail -60
stages_status
