#!/usr/bin/env bash
# The SmolLM2 recipe's levers (docs/recipe-smollm2.md, "Results by date"): each lever a short
# training from configs/smollm2-135m-diverse.yaml with one change, on the same prepared data (/tmp/recipe/data and
# data-heldout, from recipe_train.sh's prepare or PREPARE=1 here), then the fast eval (HumanEval
# 48 x 128 and the held-out chat set 48 x 128, `dflash-train eval --no-greedy`). LEVER_STEPS (default
# 400) fixes the optimizer steps, so levers that share a GPU (PER_GPU at once, default 2; SmolLM2's
# training leaves most of an H200 idle) compare on equal terms; LEVER_STEPS=0 trains LEVER_SECONDS
# (100) instead. One or two H200s, ~10 min for 8 levers at PER_GPU=4:
#     PREPARE=1 PER_GPU=4 LEVERS="base anchors1024 layers8 block8" bash dev/device/recipe_levers.sh
# Results in $OUT: levers.jsonl (one JSON line per lever as it ends), recipe_levers.log.
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/recipe_levers.log; W=/tmp/recipe; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
TARGET=${TARGET:-/tmp/smol/hf}  # a Hugging Face folder; default: the built-in SmolLM2 converted by lib.sh smol_hf
if [ "${PREPARE:-0}" = 1 ] && [ ! -f $W/data/manifest.json ] && [ -f $W/gen/gen-0.jsonl ]; then
  echo "=== prepare $(date +%T)" | tee -a $LOG
  TARGET=$TARGET WORK=$W NGPU=$NGPU STEPS=prepare timeout 200 bash scripts/smollm2_recipe_x2.sh >> $LOG 2>&1
  grep -E "^wrote|^read|no near-duplicate" $LOG | tail -4
fi
if [ ! -f $W/data/manifest.json ] || [ ! -e $TARGET ]; then echo "FRESH MACHINE: run recipe_prompts.sh, recipe_generate.sh, recipe_train.sh first" | tee -a $LOG; exit 3; fi
SEC=${LEVER_SECONDS:-100}; STEPS_N=${LEVER_STEPS:-400}; PER_GPU=${PER_GPU:-2}
# a short run warms up over its first eighth (the config's 200 steps are for full-length runs)
if [ "$STEPS_N" -gt 0 ]; then BOX=(--run.max_steps $STEPS_N --run.max_minutes 0 --optim.warmup_steps $((STEPS_N / 8))); LIMIT=900
else BOX=(--run.max_minutes $(python3 -c "print($SEC/60)")); LIMIT=$((SEC + 90)); fi
declare -A ARGS=(
  [base]=""                                         # configs/smollm2-135m-diverse.yaml as is (5 layers, block 16, cap+decay, packed target)
  [decay]="--loss.weighting decay"                  # the loss before cap+decay (with hf-target: the config before)
  [hf-target]="--target.forward hf --target.compile false"
  [layers1]="--drafter.num_layers 1"
  [layers3]="--drafter.num_layers 3"
  [block8]="--drafter.block_size 8"
  [gamma4]="--loss.gamma 4"                         # block 8's decay (gamma 4) kept at block 16: is that block 8's gain?
  [noise]="--step.noise_sigma 0.05"
  [lr3e-4]="--optim.lr 3e-4"
  [lr3e-3]="--optim.lr 3e-3"
  [init-spread]="--drafter.init_from_target spread"  # target layers 3 9 15 21 27
  [init-first]="--drafter.init_from_target layers --drafter.init_target_layers 0,1,2,3,4"
  [compiled]="--run.compile true"                   # speed (recipe_speed.sh): tau should not move
  [compiled-bf16]="--run.compile true --run.drafter_dtype bfloat16"
  [anchors1024]="--step.num_anchors 1024"           # twice the supervised blocks per target forward
  [layers8]="--drafter.num_layers 8"                # capacity: 3 layers lost 6% against 5
  [mlp3x]="--drafter.intermediate_size 4608"        # capacity at nearly no time: SmolLM2's MLP is 1,536 wide
  [taps10]="--drafter.num_taps 10"                  # twice the target layers in the context features
  [distill]="--step.label_source distill --loss.weighting decay"  # the target's whole distribution as the label (compare: decay)
  [fp8]="--target.fp8 true"                         # a drafter trained on FP8-target states, evaluated on the bf16 target
)
# data-mix levers: the training rows re-weighted by source (scripts/split_generated.py --weights),
# prepared into $W/data-<lever> first; the recipe's generated data: package-code 51% of the rows, math 25%,
# self-instructed chats 12%, stdlib-code 8%, docs 4%
declare -A MIXES=(
  [mix-chat3]="self-instruct=3"    # chats to 29% of the rows
  [mix-nopkg]="package-code=0"     # without package-code
  [mix-pkg-half]="package-code=0.5"
)
for name in "${!MIXES[@]}"; do ARGS[$name]="--data.path $W/data-$name"; done
# cap+decay and the packed target were levers and are now the config's
LEVERS=${LEVERS:-base compiled gamma4 block8 decay layers1 lr3e-4 compiled-bf16}
one() {  # GPU, lever
  local gpu=$1 name=$2 dir=$W/lever-$2
  rm -rf $dir; mkdir -p $dir
  if [ -n "${MIXES[$name]:-}" ] && [ ! -f $W/data-$name/manifest.json ]; then
    python3 scripts/split_generated.py $W/gen/train-$name.jsonl $dir/heldout.jsonl $W/gen/gen-*.jsonl \
      --exclude chat --weights "${MIXES[$name]}" >> $dir/lever.log 2>&1 &&
    python3 -m dflash_train prepare $W/gen/train-$name.jsonl --target $TARGET --output $W/data-$name --overwrite \
      --no-progress --skip-bad-rows >> $dir/lever.log 2>&1 || echo "prepare $name rc=$?" >> $LOG
  fi
  CUDA_VISIBLE_DEVICES=$gpu timeout $LIMIT python3 -m dflash_train train --config configs/smollm2-135m-diverse.yaml \
    --target.path $TARGET --data.path $W/data --data.eval_path $W/data-heldout --run.output_dir $dir \
    "${BOX[@]}" --run.eval_every 0 --run.save_every_minutes 0 --run.progress false ${ARGS[$name]} >> $dir/lever.log 2>&1 || echo "train $name rc=$?" >> $LOG
  for p in humaneval chat; do
    CUDA_VISIBLE_DEVICES=$gpu timeout 120 python3 -m dflash_train eval --target $TARGET --drafter $dir/final \
      --prompts $p --num-prompts 48 --max-new-tokens 128 --no-greedy --output $dir/eval-$p --no-progress >> $dir/lever.log 2>&1
  done
  python3 - $name $dir "${ARGS[$name]}" > $dir/result.json <<'PY'
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
    train = [r for r in rows if r.get("kind") == "train"]
    out["train_tok_per_s"] = train[-1].get("tok_per_s") if train else None  # shared GPU: compare within a wave
print(json.dumps(out))
PY
  cat $dir/result.json >> $OUT/levers.jsonl  # one line per lever as it ends: a call cut short keeps the finished ones
  echo "=== lever $name done $(date +%T)" | tee -a $LOG
}
set -- $LEVERS
while [ $# -gt 0 ]; do  # a wave: PER_GPU levers on every GPU at once
  pids=()
  for ((g = 0; g < NGPU; g++)); do for ((k = 0; k < PER_GPU; k++)); do
    [ $# -gt 0 ] && { one $g $1 & pids+=($!); shift; }
  done; done
  wait "${pids[@]}"
done
# $OUT brings back at most 8 files: the levers in levers.jsonl, their logs' tails in the log
for f in $W/lever-*/result.json; do python3 -c "import json,sys; r=json.load(open('$f')); print(r['lever'], {k: round(v['tau'],3) for k,v in r['measured'].items()})"; done | tee -a $LOG
for d in $W/lever-*; do echo "--- $d" >> $LOG; grep -vE "it/s\]" $d/lever.log | tail -25 >> $LOG; done
grep -E "rc=|rror|Traceback" $LOG | tail -10
