#!/usr/bin/env bash
# How fast the SmolLM2 recipe trains, per drafter mode: `dflash-train bench --preset smollm2-135m`
# (random weights of SmolLM2-135M's shape) at the recipe's drafter and step (5 layers, block 16,
# 65,536 tokens of 200-800-token documents and 4,096 anchors per step, as the config's eight
# 8,192-token rows of 512 anchors; target labels), alone on the GPU, one row per mode. The step's
# size matters at this model size: a step is launch-bound (one 8,192-token row per step measured
# 79K tok/s where 4 rows trained at 212K and the config's 8 at ~300K):
#   recipe-before  HF target forward, eager fp32-master drafter (the config before the packed target)
#   recipe         packed compiled target forward, eager drafter (configs/smollm2-135m-diverse.yaml)
#   compiled       + run.compile (fixed shapes, compiled drafter)
#   compiled-bf16  + run.drafter_dtype bfloat16
# One H200, ~5 min (each compiled row compiles ~1 min):
#     bash dev/device/recipe_speed.sh        # results in $OUT: train_speed.json (one object per row), train_speed.log
# ROWS_ORDER="compiled recipe" picks rows (recipe_full.sh reads them from /tmp/recipe_speed). DRY=1: the plumbing on CPU.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/train_speed.log; W=/tmp/recipe_speed; mkdir -p $OUT $W
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
PY=${PY:-python3}
source dev/device/lib.sh
if [ "${DRY:-0}" = 1 ]; then
  SHAPE=(--preset tiny --tokens 256 --doc-len 40-120 --anchors 8 --block 4 --layers 1 --warmup 1 --measure 2 --device cpu)
  export OMP_NUM_THREADS=1
else
  SHAPE=(--preset smollm2-135m --tokens 65536 --anchors 4096 --doc-len 200-800 --window 0 --warmup 10 --measure 30)
fi
B=($PY -m dflash_train bench "${SHAPE[@]}")
PACKED=(--target-forward packed --target-compile)
declare -A ROWS=(
  [recipe-before]=""
  [recipe]="${PACKED[*]}"
  [compiled]="${PACKED[*]} --compile"
  [compiled-bf16]="${PACKED[*]} --compile --drafter-dtype bfloat16"
)
for name in ${ROWS_ORDER:-recipe-before recipe compiled compiled-bf16}; do
  stage $name 200 "${B[@]}" ${ROWS[$name]} --out $W/$name.json
done
$PY - $W "$OUT/train_speed.json" <<'PY' | tee -a $LOG
import json, os, sys
w, out = sys.argv[1:]
rows = {}
for name in ("recipe-before", "recipe", "compiled", "compiled-bf16"):
    p = os.path.join(w, name + ".json")
    if os.path.exists(p):
        r = json.load(open(p))
        rows[name] = {k: r[k] for k in ("tokens_per_s", "step_ms", "time_split_ms_per_step", "peak_mem_gib", "loss_last")}
json.dump(rows, open(out, "w"), indent=1)
base = rows.get("recipe-before", {}).get("tokens_per_s")
for name, r in rows.items():
    rel = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
    print(f"RESULT {name:14s} {r['tokens_per_s']:>10,.0f} tok/s {rel:>6} {r['step_ms']:7.1f} ms/step  "
          + " ".join(f"{k} {v:.1f}" for k, v in r["time_split_ms_per_step"].items()))
PY
grep -E "^===|rror|Traceback" $LOG | tail -12
stages_status
