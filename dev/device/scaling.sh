#!/usr/bin/env bash
# Scaling over 4 or 8 GPUs of one host (nvidia-h200-x4 / -x8). It counts the GPUs; each PART fits
# a 10-minute run:
#   PART=colocated  PRESET (default qwen3-8b) colocated on 1, 2, 4 (, 8) GPUs: tok/s and scaling
#                   efficiency against 1 GPU (tok/s at k GPUs / (k x tok/s at 1)). ~6-8 min
#   PART=split      DENSE_PRESET (default dense-27b): split 5 target + 3 drafter ranks (8 GPUs; 3+1
#                   on 4) beside colocated on all GPUs; the bottleneck report's T:D advice. ~7 min
#   PART=faults     SIGTERM to torchrun (colocated and split), resume, and a SIGKILL of the last
#                   rank of colocated, on all GPUs (faults.py). ~4 min
#   PART=summary    the JSON of the parts run on this machine -> $OUT/scaling.json, RESULT lines
#     PART=colocated bash dev/device/scaling.sh     # results in $OUT: scaling.json, scaling.log
# Every PART ends with the summary. DRY=1: the plumbing on CPU (gloo, tiny preset, 2 ranks).
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/scaling.log; W=/tmp/scaling; mkdir -p $OUT $W
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=${PY:-python3}
source dev/device/lib.sh
if [ "${DRY:-0}" = 1 ]; then
  NGPU=2; BIG=tiny; HUGE=tiny; DEV=cpu; COMPILE=""; export OMP_NUM_THREADS=1
  SHAPE=(--device cpu --tokens 512 --doc-len 40-120 --anchors 16 --block 4 --layers 1 --warmup 1 --measure 2)
else
  NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
  BIG=${PRESET:-qwen3-8b}; HUGE=${DENSE_PRESET:-dense-27b}; DEV=cuda; COMPILE="--compile"; SHAPE=(--warmup 3 --measure 6)
fi
TRUN=($PY -m torch.distributed.run --standalone --nproc-per-node)  # + the process count
BENCH=(-m dflash_train bench --drafter-dtype bfloat16 $COMPILE "${SHAPE[@]}")
echo "=== scaling PART=${PART:-summary} on $NGPU GPU(s) $(date +%T)" | tee -a $LOG

case "${PART:-summary}" in
colocated)
  for k in 1 2 4 8; do
    [ "$k" -le "$NGPU" ] || continue
    stage colocated_${BIG}_x$k 170 "${TRUN[@]}" $k "${BENCH[@]}" --preset $BIG --layout colocated --out $W/colocated_${BIG}_x$k.json
  done ;;
split)
  if [ "$NGPU" -ge 8 ]; then T=5; D=3; elif [ "$NGPU" -ge 4 ]; then T=3; D=1; else T=1; D=1; fi
  stage split_${HUGE}_${T}p$D 260 "${TRUN[@]}" $((T + D)) "${BENCH[@]}" --preset $HUGE --layout split --target-ranks $T \
    --drafter-ranks $D --out $W/split_${HUGE}_${T}p$D.json
  stage colocated_${HUGE}_x$NGPU 220 "${TRUN[@]}" $NGPU "${BENCH[@]}" --preset $HUGE --layout colocated \
    --out $W/colocated_${HUGE}_x$NGPU.json ;;
faults)
  if [ "$NGPU" -ge 8 ]; then SPLIT="5 3"; elif [ "$NGPU" -ge 4 ]; then SPLIT="3 1"; else SPLIT="1 1"; fi
  FAULT=(-m dflash_train train --target.path preset:$([ "${DRY:-0}" = 1 ] && echo tiny || echo smollm2-135m)
    --data.path synthetic:4096:512 --data.plan.token_budget 2048 --drafter.num_layers 2 --step.num_anchors 64
    --run.max_steps 100000 --run.log_every 1 --run.save_every 100000 --run.device $DEV --run.progress false
    --run.tensorboard false --eval.spec_prompts null)
  rm -rf $W/faults; mkdir -p $W/faults
  stage faults 420 env NPROC=$NGPU SPLIT="$SPLIT" KILL_RANK=$((NGPU - 1)) $PY dev/device/faults.py \
    $W/faults $W "${FAULT[@]}" ;;
summary) ;;
*) echo "unknown PART=${PART}" | tee -a $LOG; exit 2 ;;
esac

$PY - "$W" "$OUT/scaling.json" <<'PY' | tee -a $LOG
import glob, json, os, re, sys
w, out = sys.argv[1:]
res = {}
for f in sorted(glob.glob(os.path.join(w, "*.json"))):
    name = os.path.basename(f)[:-5]
    if name == "faults":
        res["faults"] = json.load(open(f))
        continue
    r = json.load(open(f))
    res[name] = {k: r.get(k) for k in ("tokens_per_s", "tokens_per_s_per_gpu", "step_ms", "bottleneck")}
for name, r in res.items():  # efficiency against the same preset on one GPU
    m = re.fullmatch(r"colocated_(.+)_x(\d+)", name)
    one = res.get(f"colocated_{m.group(1)}_x1") if m else None
    if m and one and one.get("tokens_per_s"):
        r["efficiency_vs_1gpu"] = r["tokens_per_s"] / (int(m.group(2)) * one["tokens_per_s"])
json.dump(res, open(out, "w"), indent=1)
for name, r in res.items():
    if name == "faults":
        for x in r:
            print("RESULT fault", json.dumps(x)[:300])
        continue
    eff = f"  efficiency {r['efficiency_vs_1gpu']:.1%}" if "efficiency_vs_1gpu" in r else ""
    print(f"RESULT {name}: {r['tokens_per_s'] or 0:,.0f} tok/s ({r['tokens_per_s_per_gpu'] or 0:,.0f} per GPU), "
          f"{r['step_ms'] or 0:.0f} ms/step{eff}")
    if r.get("bottleneck"):
        print("  " + r["bottleneck"].replace("\n", "\n  "))
PY
grep -E "^===|rror|Traceback" $LOG | tail -12
stages_status
