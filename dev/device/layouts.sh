#!/usr/bin/env bash
# The two layouts on two GPUs: split 1 target + 1 drafter rank (hidden states over NCCL) against
# colocated x2 on the PRESET's shape (default qwen3-8b, compiled bf16 drafter); split's losses
# against one process on the same batches (the real SmolLM2 target when /tmp/smol/hf exists, else
# its shape); SIGTERM to torchrun (colocated and split: time to exit, checkpoint, resume) and a
# SIGKILL of one rank (faults.py). Two H200s (nvidia-h200-x2), ~6-8 min:
#     bash dev/device/layouts.sh             # results in $OUT: split_<preset>.json,
#                                              # colocated_<preset>.json, faults.json, layouts.json, layouts.log
# SKIP_BENCH=1 / SKIP_LOSSES=1 / SKIP_FAULTS=1 leave parts out; LAYOUTS="split" (default "split
# colocated") picks the throughput rows. DRY=1: the plumbing on CPU (gloo, tiny preset), a few minutes.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/layouts.log; W=${W:-/tmp/layouts}; mkdir -p $OUT; rm -rf $W; mkdir -p $W
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site4 .whl/*.whl >> $LOG 2>&1
export PYTHONPATH=/tmp/site4:$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PY:-python3}
if [ "${DRY:-0}" = 1 ]; then
  BIG=tiny; SMALL=tiny; DEV=cpu; COMPILE=""; export OMP_NUM_THREADS=1
  BENCH_DEV="--device cpu --tokens 512 --doc-len 40-120 --anchors 16 --block 4 --layers 1"  # the bench shape: 79 s a CPU step
else
  BIG=${PRESET:-qwen3-8b}; SMALL=smollm2-135m; DEV=cuda; COMPILE="--compile"; BENCH_DEV=""
fi
source dev/device/lib.sh
TRUN=($PY -m torch.distributed.run --standalone --nproc-per-node 2)
$PY -c "import torch; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" >> $LOG 2>&1

if [ "${SKIP_BENCH:-0}" != 1 ]; then
# 1. throughput: split 1+1 (NCCL between the GPUs) and colocated x2, same preset and batches
LAYOUTS=${LAYOUTS:-split colocated}
[[ " $LAYOUTS " == *" split "* ]] && stage split_${BIG} 150 "${TRUN[@]}" -m dflash_train bench --preset $BIG --layout split --target-ranks 1 --drafter-ranks 1 \
  --drafter-dtype bfloat16 $COMPILE --warmup 5 --measure 10 $BENCH_DEV --out $OUT/split_${BIG}.json
[[ " $LAYOUTS " == *" colocated "* ]] && stage colocated_${BIG} 120 "${TRUN[@]}" -m dflash_train bench --preset $BIG --layout colocated --drafter-dtype bfloat16 \
  $COMPILE --warmup 3 --measure 6 $BENCH_DEV --out $OUT/colocated_${BIG}.json

fi
# 2. the same batches trained by split 1+1 and by one process: the losses (bf16 noise on GPU)
T=preset:$SMALL; [ -f /tmp/smol/hf/config.json ] && [ "${DRY:-0}" != 1 ] && T=/tmp/smol/hf
TRAIN=(-m dflash_train train --target.path $T --data.path synthetic:2048:512 --data.plan.token_budget 2048
  --drafter.num_layers 2 --step.num_anchors 64 --run.max_steps 12 --run.log_every 1 --run.device $DEV
  --run.progress false --run.tensorboard false --eval.spec_prompts null)
if [ "${SKIP_LOSSES:-0}" != 1 ]; then
stage losses_single 60 $PY "${TRAIN[@]}" --run.output_dir $W/single
stage losses_split 70 "${TRUN[@]}" "${TRAIN[@]}" --run.output_dir $W/split --pipeline.layout split \
  --pipeline.target_ranks 1 --pipeline.drafter_ranks 1
fi

# 3. stops and deaths: time to exit, exit code, checkpoint, resume (helper in Python for exact timing)
FAULT=(-m dflash_train train --target.path preset:$SMALL --data.path synthetic:4096:512 --data.plan.token_budget 2048
  --drafter.num_layers 2 --step.num_anchors 64 --run.max_steps 100000 --run.log_every 1 --run.save_every 100000
  --run.device $DEV --run.progress false --run.tensorboard false --eval.spec_prompts null)
[ "${SKIP_FAULTS:-0}" = 1 ] || stage faults 200 $PY dev/device/faults.py $W $OUT "${FAULT[@]}"

$PY - "$OUT" "$W" <<'PY' >> $LOG 2>&1
import glob, json, os, sys
out, w = sys.argv[1], sys.argv[2]
def losses(d):
    p = os.path.join(w, d, "metrics.jsonl")
    rows = [json.loads(x) for x in open(p)] if os.path.exists(p) else []
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}
a, b = losses("single"), losses("split")
res = {"losses_single": a, "losses_split": b,
       "max_rel_diff": max((abs(a[k] - b[k]) / abs(a[k]) for k in a if k in b), default=None)}
for f in sorted(glob.glob(os.path.join(out, "*_*.json"))):
    if os.path.basename(f).startswith(("split_", "colocated_")):
        r = json.load(open(f)); name = os.path.basename(f)[:-5]
        res[name] = {k: r.get(k) for k in ("tokens_per_s", "step_ms", "time_split_ms_per_step", "bottleneck")}
        res[name]["ranks"] = [{k: x.get(k) for k in ("rank", "role", "tok_per_s", "queue_wait_s",
                               "median_busy_ms_per_batch", "mean_queue_fill")} for x in r.get("pipeline") or []]
json.dump(res, open(os.path.join(out, "layouts.json"), "w"), indent=1)
print("losses split vs single: max rel diff", res["max_rel_diff"], "over", len(b), "steps")
for k, v in res.items():
    if isinstance(v, dict) and "tokens_per_s" in v:
        print(f"RESULT {k}: {v['tokens_per_s'] or 0:,.0f} tok/s, {v['step_ms'] or 0:.0f} ms/step")
        for x in v["ranks"]:
            print(f"  rank {x['rank']} {x['role']}: queue wait {x['queue_wait_s'] or 0:.1f}s, "
                  f"{x['median_busy_ms_per_batch'] or 0:.0f} ms/batch, fill {x['mean_queue_fill'] or 0:.2f}")
        print("  " + (v["bottleneck"] or "").replace("\n", "\n  "))
PY
grep -E "^===|^RESULT|^  rank|bottleneck:|max rel diff|^FAULT|Error|error:" $LOG | grep -v "^\s*$" | tail -45
stages_status
