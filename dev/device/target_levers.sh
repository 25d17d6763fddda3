#!/usr/bin/env bash
# The levers of the target forward, one table: `dflash-train bench --levers` on the PRESET's shape
# (default qwen3-8b, random weights; one packed row of 8192 tokens, 512 anchors, block 16, drafter
# window 2048, target labels, compiled bf16 drafter), in two processes appending to one JSON (the
# eager target rows, then the compiled-target rows); then DENSE_PRESET (default dense-27b) with the
# settings of the table's fastest bf16 row (`--like`). One H200, ~8 min (compiles ~1 min per shape;
# stage limits add up to 580 s).
#     bash dev/device/target_levers.sh      # results in $OUT: levers_qwen3_8b.json, dense_27b.json,
#                                             # target_levers.log
# PART=levers or PART=dense runs one half (PART=dense on a warm machine reads the table the first
# left in /tmp/target_levers, or the file LIKE names). PART=profile: the target forward alone
# (bench/profile_target.py: Hugging Face, and packed + compiled + SDPA, default cudnn), median ms
# and the top kernels, ~3 min. DRY=1: the plumbing on CPU with the tiny preset.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/target_levers.log; W=/tmp/target_levers; mkdir -p $OUT $W
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PY=${PY:-python3}
PART=${PART:-all}
if [ "${DRY:-0}" = 1 ]; then
  BIG=tiny; HUGE=tiny; SHAPE="--tokens 256 --doc-len 40-120 --anchors 8 --block 4 --layers 1 --warmup 1 --measure 2 --device cpu"
  export OMP_NUM_THREADS=1
else
  BIG=${PRESET:-qwen3-8b}; HUGE=${DENSE_PRESET:-dense-27b}; SHAPE="--warmup 5 --measure 10"  # bench defaults: 8192 tokens, 512 anchors, block 16, window 2048, target labels
fi
source dev/device/lib.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >> $LOG 2>&1
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> $LOG 2>&1
B=($PY -m dflash_train bench --compile --drafter-dtype bfloat16 $SHAPE)
T=$W/levers_${BIG//-/_}.json

if [ "$PART" != dense ]; then
  rm -f $T
  # eager target forwards: one drafter compile (~65 s), then ~10 s a row; the rows that matter
  # most first (a stage cut by its limit keeps the rows it finished: the JSON is rewritten per row)
  stage levers_eager 230 "${B[@]}" --preset $BIG --out $T \
    --levers baseline,packed,packed-cudnn,packed-flash,overlap,hf-cudnn,hf-flash,fp8-unfused,data-labels
  # compiled target forwards (one compile each for the bf16 and FP8 pieces; the all-* rows reuse them)
  stage levers_compiled 190 "${B[@]}" --preset $BIG --out $T --append \
    --levers packed-compiled,all-bf16,fp8-compiled,all-fp8
  cp $T $OUT/
fi
if [ "$PART" = profile ]; then  # optional (not in PART=all): kernel tables of the target forward alone, ~3 min
  P=($PY bench/profile_target.py --preset $BIG $([ "${DRY:-0}" = 1 ] && echo "--tokens 256 --device cpu"))
  stage profile_hf 120 "${P[@]}" --out $OUT/profile_hf.json
  stage profile_packed_compiled 200 "${P[@]}" --set forward=packed compile=true sdpa_backend=${SDPA:-cudnn} \
    --out $OUT/profile_packed_compiled.json
  grep -E "^===|forward_ms_median|Self CUDA time total|rror" $LOG | cut -c1-300; exit 0
fi
if [ "$PART" != levers ]; then
  TABLE=${LIKE:-$T}
  if [ -f $TABLE ]; then LIKE_ARGS=(--like $TABLE); else LIKE_ARGS=(); echo "no lever table: dense-27b with default settings" | tee -a $LOG; fi
  stage dense_27b $([ "$PART" = dense ] && echo 400 || echo 160) "${B[@]}" --preset $HUGE "${LIKE_ARGS[@]}" \
    --out $OUT/dense_${HUGE//-/_}.json
fi
grep -E "^===|^\| |^bench |tokens/s|time/step|peak memory|rror|Traceback|settings of the fastest" $LOG | cut -c1-200 | tail -45
stages_status
