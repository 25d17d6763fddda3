#!/usr/bin/env bash
# Targets bigger than one GPU, sharded over a group of GPUs (pipeline.target_group_size, FSDP2;
# docs/sharded-targets.md), on random weights at real shapes. Each PART fits one call (< 10 min):
#     PART=x2    bash dev/device/sharded_target.sh   # 2 GPUs: the Llama-3.3-70B shape shared by both,
#                                                    # colocated (bench_llama70b_x2.json; auto: the packed
#                                                    # compiled forward, gathering each layer itself)
#     PART=x2hf  ...   # the same on the Hugging Face forward (FSDP2's hooks gather): bench_llama70b_x2_hf.json
#     PART=kill  ...   # 2 GPUs: a shard rank SIGKILLed mid-run (Qwen3-8B shape, G = 2): every rank gone
#                      # within 60 s, the survivor naming it, then --resume (faults.json)
#     PART=moe   ...   # 8 GPUs: the Qwen3-235B-A22B shape over all eight, colocated (bench_qwen3_235b_x8.json);
#                      # NPROC=4 tries it over four (470 GB / 4 leaves no room for the drafter on a 141 GB GPU)
# Per-rank memory is the JSON's peak_mem_gib; the target's share of the step its time split.
# DRY=1: the plumbing on a CPU (gloo, the tiny preset, two processes; PY=.venv/bin/python there).
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/sharded_target.log; W=${W:-/tmp/sharded}; mkdir -p "$OUT"; rm -rf "$W"; mkdir -p "$W"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PY:-python3}
PART=${PART:-x2}
if [ "${DRY:-0}" = 1 ]; then
  P70=tiny; PMOE=tiny; PKILL=tiny; DEV=cpu; NPROC_MOE=2; export OMP_NUM_THREADS=1
  SHAPE="--device cpu --tokens 256 --doc-len 40-120 --anchors 8 --block 4 --layers 1 --warmup 1 --measure 2"
else
  P70=llama3.3-70b; PMOE=qwen3-235b-a22b; PKILL=qwen3-8b; DEV=cuda; NPROC_MOE=${NPROC:-8}
  SHAPE="--warmup 2 --measure 4"
fi
source dev/device/lib.sh
$PY -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" >> "$LOG" 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv >> "$LOG" 2>&1
TRUN=($PY -m torch.distributed.run --standalone --nproc-per-node)

case "$PART" in
  x2)
    stage bench_llama70b_x2 540 "${TRUN[@]}" 2 -m dflash_train bench --preset $P70 --layout colocated --target-group-size 2 \
      $SHAPE --out "$OUT/bench_llama70b_x2.json" ;;
  x2hf)
    stage bench_llama70b_x2_hf 540 "${TRUN[@]}" 2 -m dflash_train bench --preset $P70 --layout colocated \
      --target-group-size 2 --target-forward hf $SHAPE --out "$OUT/bench_llama70b_x2_hf.json" ;;
  kill)
    FAULT=(-m dflash_train train --target.path preset:$PKILL --data.path synthetic:4096:512 --data.plan.token_budget 2048
      --drafter.num_layers 2 --step.num_anchors 64 --run.max_steps 100000 --run.log_every 1 --run.save_every 3
      --run.device $DEV --run.progress false --run.tensorboard false --eval.spec_prompts null
      --pipeline.target_group_size 2)
    stage kill_shard_rank 420 env NPROC=2 CASES=kill KILL_RANK=1 $PY dev/device/faults.py "$W" "$OUT" "${FAULT[@]}" ;;
  moe)
    stage bench_qwen3_235b_x$NPROC_MOE 560 "${TRUN[@]}" "$NPROC_MOE" -m dflash_train bench --preset $PMOE --layout colocated \
      --target-group-size "$NPROC_MOE" $SHAPE --out "$OUT/bench_qwen3_235b_x$NPROC_MOE.json" ;;
  *) echo "unknown PART $PART" >&2; exit 2 ;;
esac
grep -E "^bench |tokens/s|peak memory|time/step|FAULT|rror" "$LOG" | tail -12
stages_status
