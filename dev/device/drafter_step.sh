#!/usr/bin/env bash
# Training throughput and the drafter step of the recommended bf16 setting: `dflash-train bench
# --compile --drafter-dtype bfloat16 --target-forward packed --target-compile --profile` (packed
# compiled target, compiled bf16 drafter; one packed row of 8192 tokens, 512 anchors, block 16,
# window 2048, target labels; random weights of the PRESET's shape, default qwen3-8b), one row
# per ROWS entry, each with a kernel table of 3 profiled steps after the measured ones. One H200,
# ~2 min a row (a compile; ~3 min with autotune).
#   fused       loss.fused_head on (the default in compiled mode)
#   unfused     loss.fused_head off (the LM head's chunk math op by op)
#   fp8         fused + FP8 target (also checks the MFU against the measured float8 peak)
#   overlap     + pipeline.overlap_target
#   autotune    + run.compile_autotune (the recommended configuration; registry throughput.qwen3_8b.*)
#   autotune_fusedopt  autotune with torch's fused AdamW instead of the compiled step
#   autotune_chunk8k   autotune with the LM head's 7,680 drafter rows in one chunk (loss.chunk_rows 8192)
# A row named twice (ROWS="autotune autotune autotune") runs twice: <row>, <row>_2, ...
#     ROWS=autotune bash dev/device/drafter_step.sh                 # default ROWS="fused unfused"
#     PRESET=dense-27b ROWS=overlap bash dev/device/drafter_step.sh  # registry throughput.dense_27b.tok_per_s
# Results in $OUT: <TAG><row>.json, <TAG><row>.kernels.txt, drafter_step.log. SRC=another/src runs
# another tree of the package (an A/B on one machine: step_ab.sh). DRY=1: the tiny preset on CPU.
set -u
TAG=${TAG:-}  # prefix of the result files (two presets or trees in one run)
OUT=${OUT:-/tmp/out}; LOG=$OUT/drafter_step.log; mkdir -p $OUT
export PYTHONPATH=${SRC:-$PWD/src} PYTHONUNBUFFERED=1  # SRC=: another tree of the package
source dev/device/lib.sh
if [ "${DRY:-0}" = 1 ]; then
  SHAPE=(--preset tiny --tokens 256 --doc-len 40-120 --anchors 8 --block 4 --layers 1 --warmup 1 --measure 2 --device cpu)
  export OMP_NUM_THREADS=1
else
  SHAPE=(--preset ${PRESET:-qwen3-8b} --warmup 5 --measure 10)
fi
B=(python3 -m dflash_train bench --compile --drafter-dtype bfloat16 --target-forward packed --target-compile --profile "${SHAPE[@]}")
declare -A ARGS=(
  [fused]=""
  [unfused]="--set loss.fused_head=false"
  [fp8]="--fp8-target"
  [overlap]="--overlap"
  [autotune]="--set run.compile_autotune=true"
  [autotune_fusedopt]="--set run.compile_autotune=true --set optim.compiled_step=false"
  [autotune_chunk8k]="--set run.compile_autotune=true --set loss.chunk_rows=8192"
)
# A row named twice (ROWS="autotune autotune") is run twice; each run gets its own files
# (<row>, <row>_2, ...) so a repeat for the spread keeps every result.
declare -A SEEN=(); NAMES=()
for row in ${ROWS:-fused unfused}; do
  SEEN[$row]=$(( ${SEEN[$row]:-0} + 1 ))
  name=$TAG$row; [ ${SEEN[$row]} -gt 1 ] && name=${name}_${SEEN[$row]}
  NAMES+=($name)
  stage $name ${ROW_LIMIT:-200} "${B[@]}" ${ARGS[$row]} --out $OUT/$name.json
done
grep -E "^===|^bench |tokens/s|time/step|achieved|peak memory|rror|Traceback" $LOG | cut -c1-220 | tail -30
for name in "${NAMES[@]}"; do
  [ -f $OUT/$name.kernels.txt ] && { echo "--- $name kernels"; head -30 $OUT/$name.kernels.txt | cut -c1-200
    sed -n '/^GPU timeline/,$p' $OUT/$name.kernels.txt | cut -c1-260; }
done
stages_status
