#!/usr/bin/env bash
# A fresh machine made ready for the SmolLM2 recipe's steps after generation (prepare, levers,
# train, eval: recipe_full.sh, recipe_levers.sh), from what the tree carries in two runs of at most
# 64 MiB each: the first carries .smol1 and .recipe1 (`RESTORE=1 bash dev/device/restore.sh`
# copies them to /tmp/smol), the second .smol2, .recipe2 and .whl (`bash dev/device/restore.sh`
# joins the GGUF, converts it, installs the wheels, unpacks the conversations into /tmp/recipe/gen).
# The recipe parts: one xz stream (recipe_generate.sh's export) re-split so each half fits beside a
# GGUF half. ~1 min.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/restore.log; mkdir -p $OUT /tmp/smol /tmp/recipe
if [ "${RESTORE:-2}" = 1 ]; then
  source dev/device/lib.sh; smol_keep; cp .recipe1/recipe.tar.xz.part_* /tmp/smol/ && ls -la /tmp/smol | tee -a $LOG; exit
fi
[ -f /tmp/smol/part_aa ] || { echo "FRESH MACHINE: run RESTORE=1 first" | tee -a $LOG; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >> $LOG 2>&1
export PYTHONPATH=/tmp/site:$PWD/src
source dev/device/lib.sh
smol_hf
if [ ! -f /tmp/recipe/gen/gen-0.jsonl ]; then
  cat /tmp/smol/recipe.tar.xz.part_* .recipe2/recipe.tar.xz.part_* | xz -d | tar -C /tmp/recipe -xf -
fi
ls -la /tmp/smol/hf | tee -a $LOG; wc -l /tmp/recipe/gen/gen-*.jsonl | tee -a $LOG
