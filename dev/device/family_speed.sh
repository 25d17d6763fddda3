#!/usr/bin/env bash
# Throughput of the targets people serve, and of the defaults, on one H200 (random weights at real
# shapes): each PART fits one call of under 10 minutes; the JSON and the log land in $OUT.
#     PART=defaults  bash dev/device/family_speed.sh   # qwen3-8b: `bench` with no options (auto) and
#                                                      # the recommended flags, one after the other
#     PART=gemma     ...   # gemma3-27b: bench (auto = packed compiled bf16), then the same with the
#                            # next batch's target forward overlapped (--overlap, as dense-27b's 8,140 was)
#     PART=gemma_gkv ...   # gemma3-27b with --overlap and repeated key/value heads (--no-grouped-kv), then the
#                            # same with grouped ones (auto's choice for Gemma), then grouped without overlap;
#                            # each with --profile (the kernel table of 3 steps after the measured ones)
#     PART=gemma_gen ...   # gemma3-27b: profile_generate, 64 slots
#     PART=gpt_oss   ...   # gpt-oss-20b: bench on the Hugging Face forward, then packed compiled
#     PART=gpt_oss_gen ... # gpt-oss-20b: profile_generate, 64 slots
#     PART=moe_gen   ...   # qwen3-30b-a3b: profile_generate at 256 slots against the HBM bound
#     PART=moe_train ...   # qwen3-30b-a3b: bench (auto), then with --overlap
#     PART=moe_tuned ...   # qwen3-30b-a3b: --overlap with run.compile_autotune (the recommended
#                            # configuration of docs/performance.md), then auto with the same and
#                            # --profile (the kernel table of 3 steps after the measured ones)
#     PART=gemma_tuned ... # gemma3-27b: the same two (TUNED_RUNS="overlap" or "plain": one of them)
#     PART=mixtral   ...   # mixtral-8x7b: bench on the Hugging Face forward, then auto (packed compiled),
#                            # then profile_generate at 64 slots (PRESET=phi-4: the same for Phi-4)
#     PART=latent    ...   # glm4.7-flash (latent attention): bench on the Hugging Face forward, then auto,
#                            # then profile_generate at 64 slots (the latent cache)
#     PART=hybrid_gen ... # qwen3.5-27b (PRESET=qwen3.5-35b-a3b: the MoE): profile_generate at 64 slots, the linear-
#                            # attention layers decoded from their per-slot states (generate/linear_state.py)
#     PART=fla       ...   # qwen3.5-27b (PRESET=qwen3.5-35b-a3b: the MoE) on the Hugging Face forward with
#                            # transformers' pure-PyTorch gated delta net, then with flash-linear-attention's
#                            # kernels (carried wheels: .whl/flash_linear_attention-*.whl, .whl/fla_core-*.whl)
#                            # on the Hugging Face forward and on auto (the packed forward)
# DRY=1: the plumbing on a CPU with the tiny preset.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/family_speed.log; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PY=${PY:-python3}
PART=${PART:-defaults}
if [ "${DRY:-0}" = 1 ]; then
  SHAPE="--tokens 256 --doc-len 40-120 --anchors 8 --block 4 --layers 1 --warmup 1 --measure 2 --device cpu"
  GEN="--slots 4 --prompt-len 24 --steps 4 --warmup 2 --device cpu"
  P8=tiny; PG=tiny; PO=tiny; PM=tiny
  export OMP_NUM_THREADS=1
else
  SHAPE="--warmup 3 --measure 6"
  GEN="--steps 20"  # the bound at the GPU's own bandwidth (bench/profile_generate.py PEAK_GBS)
  P8=qwen3-8b; PG=gemma3-27b; PO=gpt-oss-20b; PM=qwen3-30b-a3b
fi
source dev/device/lib.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> "$LOG" 2>&1
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> "$LOG" 2>&1
B=($PY -m dflash_train bench $SHAPE ${BENCH_ARGS:-})  # BENCH_ARGS="--set target.grouped_kv=true": a lever on every bench
FAST=(--compile --drafter-dtype bfloat16 --target-forward packed --target-compile)
[ "${DRY:-0}" = 1 ] && FAST=(--target-forward packed)  # compiling costs minutes on a CPU

case "$PART" in
  defaults)
    stage bench_default 280 "${B[@]}" --preset $P8 --out "$OUT/bench_qwen3_8b_default.json"
    stage bench_recommended 280 "${B[@]}" --preset $P8 "${FAST[@]}" --out "$OUT/bench_qwen3_8b_recommended.json" ;;
  gemma)
    stage bench_gemma 280 "${B[@]}" --preset $PG --out "$OUT/bench_gemma3_27b.json"
    stage bench_gemma_overlap 280 "${B[@]}" --preset $PG --overlap --out "$OUT/bench_gemma3_27b_overlap.json" ;;
  gemma_gkv)
    stage bench_gemma_overlap 200 "${B[@]}" --preset $PG --overlap --no-grouped-kv --profile --out "$OUT/bench_gemma3_27b_overlap.json"
    stage bench_gemma_overlap_gkv 200 "${B[@]}" --preset $PG --overlap --grouped-kv --profile --out "$OUT/bench_gemma3_27b_overlap_gkv.json"
    stage bench_gemma_gkv 170 "${B[@]}" --preset $PG --grouped-kv --out "$OUT/bench_gemma3_27b_gkv.json" ;;
  gemma_gen)
    stage generate_gemma 300 $PY bench/profile_generate.py preset:$PG --slots 64 --prompt-len 512 $GEN \
      --out "$OUT/generate_gemma3_27b.json" ;;
  gpt_oss_gen)
    stage generate_gpt_oss 300 $PY bench/profile_generate.py preset:$PO --slots 64 --prompt-len 512 $GEN \
      --out "$OUT/generate_gpt_oss_20b.json" ;;
  gpt_oss)
    stage bench_gpt_oss_hf 250 "${B[@]}" --preset $PO --target-forward hf --out "$OUT/bench_gpt_oss_20b_hf.json"
    stage bench_gpt_oss_packed 300 "${B[@]}" --preset $PO "${FAST[@]}" --out "$OUT/bench_gpt_oss_20b_packed.json" ;;
  moe_train)
    stage bench_moe 280 "${B[@]}" --preset $PM --out "$OUT/bench_qwen3_30b_a3b.json"
    stage bench_moe_overlap 280 "${B[@]}" --preset $PM --overlap --out "$OUT/bench_qwen3_30b_a3b_overlap.json" ;;
  moe_tuned|gemma_tuned)
    P=$([ "$PART" = moe_tuned ] && echo $PM || echo $PG); TUNE=(--set run.compile_autotune=true)
    [ "${DRY:-0}" = 1 ] && TUNE=()  # autotuning needs a GPU compile
    case " ${TUNED_RUNS:-overlap plain} " in *" overlap "*)
      stage bench_${PART}_overlap 330 "${B[@]}" --preset $P --overlap "${TUNE[@]}" --out "$OUT/bench_${PART}_overlap.json" ;; esac
    case " ${TUNED_RUNS:-overlap plain} " in *" plain "*)
      stage bench_${PART} 280 "${B[@]}" --preset $P "${TUNE[@]}" --profile --out "$OUT/bench_${PART}.json" ;; esac ;;
  fla)
    PQ=$([ "${DRY:-0}" = 1 ] && echo tiny-qwen3.5 || echo "${PRESET:-qwen3.5-27b}"); N=${PQ//[.-]/_}
    FEW=(--warmup 2 --measure 4)  # (bench takes the last --warmup/--measure given)
    stage bench_${N}_fallback 280 "${B[@]}" --warmup 1 --measure 2 --preset $PQ --target-forward hf \
      --out "$OUT/bench_${N}_fallback.json"
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla-site .whl/flash_linear_attention-*.whl \
      .whl/fla_core-*.whl >> "$LOG" 2>&1 || echo "the fla wheels did not install (dev/fetch_wheels.sh)" | tee -a "$LOG"
    stage bench_${N}_fla_hf 280 env PYTHONPATH=/tmp/fla-site:$PYTHONPATH "${B[@]}" "${FEW[@]}" --preset $PQ \
      --target-forward hf --out "$OUT/bench_${N}_fla_hf.json"
    stage bench_${N}_fla 280 env PYTHONPATH=/tmp/fla-site:$PYTHONPATH "${B[@]}" "${FEW[@]}" --preset $PQ \
      --out "$OUT/bench_${N}_fla.json" ;;
  mixtral)
    PX=$([ "${DRY:-0}" = 1 ] && echo tiny || echo "${PRESET:-mixtral-8x7b}"); N=${PX//[.-]/_}
    stage bench_${N}_hf 250 "${B[@]}" --preset $PX --target-forward hf --out "$OUT/bench_${N}_hf.json"
    stage bench_${N} 280 "${B[@]}" --preset $PX --out "$OUT/bench_${N}.json"
    stage generate_${N} 250 $PY bench/profile_generate.py preset:$PX --slots 64 --prompt-len 256 $GEN \
      --out "$OUT/generate_${N}.json" ;;
  latent)
    PL=$([ "${DRY:-0}" = 1 ] && echo tiny || echo glm4.7-flash)
    stage bench_glm4_7_flash_hf 250 "${B[@]}" --preset $PL --target-forward hf --out "$OUT/bench_glm4_7_flash_hf.json"
    stage bench_glm4_7_flash 280 "${B[@]}" --preset $PL --out "$OUT/bench_glm4_7_flash.json"
    stage generate_glm4_7_flash 250 $PY bench/profile_generate.py preset:$PL --slots 64 --prompt-len 256 $GEN \
      --out "$OUT/generate_glm4_7_flash.json" ;;
  hybrid_gen)
    PH=$([ "${DRY:-0}" = 1 ] && echo tiny-qwen3.5 || echo "${PRESET:-qwen3.5-27b}"); N=${PH//[.-]/_}
    stage generate_${N} 400 $PY bench/profile_generate.py preset:$PH --slots 64 --prompt-len 256 $GEN \
      --out "$OUT/generate_${N}.json" ;;
  moe_gen)
    stage generate_qwen3_30b_a3b 500 $PY bench/profile_generate.py preset:$PM --slots 256 --prompt-len 256 $GEN \
      --out "$OUT/generate_qwen3_30b_a3b.json" ;;
  *) echo "unknown PART $PART" >&2; exit 2 ;;
esac
stages_status
