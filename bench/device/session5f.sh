#!/usr/bin/env bash
# H200 session 5, call F (after C: needs /tmp/recipe/data and data-heldout): the levers
# sweep of docs/recipe-smollm2.md. Each lever is a short training (LEVER_SECONDS, default 100 s)
# on the same prepared data, one GPU per lever, two levers at once on two GPUs (one on one), then the fast eval
# (HumanEval 48 x 128 and the held-out chat set 48 x 128). One JSON per lever in $OUT/levers/.
# Levers beyond the first 8 go to a second call (LEVERS="..." to pick). ~9 min for 8 levers.
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/session5f.log; W=/tmp/recipe; mkdir -p $OUT/levers
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -f $W/data/manifest.json ] || [ ! -f /tmp/smol/hf/model.safetensors ]; then echo "FRESH MACHINE: run A-C first" | tee -a $LOG; exit 3; fi
SEC=${LEVER_SECONDS:-100}
declare -A ARGS=(
  [base]=""                                         # configs/smollm2-135m-diverse.yaml as is (5 layers, block 16, decay)
  [layers1]="--drafter.num_layers 1"
  [layers3]="--drafter.num_layers 3"
  [block8]="--drafter.block_size 8"
  [cap]="--loss.weighting cap+decay"               # acceptance-aware
  [noise]="--step.noise_sigma 0.05"
  [lr3e-4]="--optim.lr 3e-4"
  [lr3e-3]="--optim.lr 3e-3"
  [init-spread]="--drafter.init_from_target spread"  # target layers 3 9 15 21 27
  [init-first]="--drafter.init_from_target layers --drafter.init_target_layers 0,1,2,3,4"
)
LEVERS=${LEVERS:-base layers1 layers3 block8 cap noise lr3e-4 lr3e-3 init-spread init-first}
one() {  # GPU, lever
  local gpu=$1 name=$2 dir=$W/lever-$2
  rm -rf $dir
  CUDA_VISIBLE_DEVICES=$gpu timeout $((SEC + 90)) python3 -m dflash_train train --config configs/smollm2-135m-diverse.yaml \
    --target.path /tmp/smol/hf --data.path $W/data --data.eval_path $W/data-heldout --run.output_dir $dir \
    --run.max_minutes $(python3 -c "print($SEC/60)") --run.eval_every 0 --run.save_every_minutes 0 --run.progress false ${ARGS[$name]} >> $LOG.$name 2>&1 || echo "train $name rc=$?" >> $LOG
  for p in humaneval chat; do
    CUDA_VISIBLE_DEVICES=$gpu timeout 120 python3 -m dflash_train eval --target /tmp/smol/hf --drafter $dir/final \
      --prompts $p --num-prompts 48 --max-new-tokens 128 --no-greedy --output $dir/eval-$p --no-progress >> $LOG.$name 2>&1
  done
  python3 - $name $dir "${ARGS[$name]}" > $OUT/levers/$name.json <<'PY'
import json, os, sys
name, d, args = sys.argv[1:]
out = {"lever": name, "args": args, "measured": {}}
for p in ("humaneval", "chat"):
    f = os.path.join(d, f"eval-{p}", "report.json")
    if os.path.exists(f):
        o = json.load(open(f))["overall"]
        out["measured"][p] = {"tau": o["tau"], "tau_by_position": o.get("tau_by_position")}
m = os.path.join(d, "metrics.jsonl")
if os.path.exists(m):
    rows = [json.loads(l) for l in open(m) if l.strip()]
    out["last_metrics"] = rows[-1] if rows else None
print(json.dumps(out, indent=2))
PY
  echo "=== lever $name done $(date +%T)" | tee -a $LOG
}
set -- $LEVERS
while [ $# -gt 0 ]; do
  one 0 $1 & a=$!; shift
  if [ $# -gt 0 ] && [ "$NGPU" -gt 1 ]; then one 1 $1 & b=$!; shift; wait $b; fi
  wait $a
done
for f in $OUT/levers/*.json; do python3 -c "import json,sys; r=json.load(open('$f')); print(r['lever'], {k: round(v['tau'],3) for k,v in r['measured'].items()})"; done
grep -E "rc=|rror|Traceback" $LOG $LOG.* | tail -10
