#!/usr/bin/env bash
# The SmolLM2 recipe's full-length run on one or two H200s, on conversations generated earlier
# (carried back in xz parts: restore.sh), in three runs of <= 10 min each, back to back on one machine:
#   1  RESTORE=1 bash dev/device/restore.sh; ENGINE=0 bash dev/device/recipe_prompts.sh;
#      ROWS_ORDER="compiled recipe" bash dev/device/recipe_speed.sh   (the train-speed rows)
#   2  PART=1 bash dev/device/recipe_full.sh   (~9.5 min) restore, prepare, train TRAIN_MINUTES
#      (7.5); the drafter mode (MODE=auto|recipe|compiled) and run.max_steps are chosen here from
#      the speed rows: compiled when it trains >= 15% faster, the schedule sized to TOTAL_MINUTES of
#      training (12) at the measured rate (x 0.85 for evals, saves, compiles)
#   3  PART=2 bash dev/device/recipe_full.sh   (~10 min) resume for the rest (TRAIN_MINUTES 4.5),
#      then the measured eval (recipe_eval.sh; EVAL=0 leaves it to PART=3, the eval alone)
#     MODE=recipe TOTAL_MINUTES=17.86 TRAIN_MINUTES=8.3 PART=1 bash dev/device/recipe_full.sh   # one run of 2,199 steps
# The chosen arguments live in /tmp/recipe/train_args.txt so the resume uses the same ones. It
# counts the GPUs: on two, the recipe trains colocated (torchrun), each replica at the row's rate.
# Results in $OUT: recipe_full.log, metrics_part<PART>.jsonl, and recipe_eval.sh's.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/recipe_full.log; W=/tmp/recipe; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
source dev/device/lib.sh
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
if [ "${PART:-1}" = 3 ]; then
  EVAL_SOURCE_PROMPTS=${EVAL_SOURCE_PROMPTS:-16} bash dev/device/recipe_eval.sh; exit
fi
if [ "${PART:-1}" = 1 ]; then
  bash dev/device/restore.sh || exit 3
  python3 - /tmp/recipe_speed "${TOTAL_MINUTES:-12}" "${MODE:-auto}" > $W/train_args.txt <<'PY'
import json, os, sys
rows_dir, total_min, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rate = {}
for name in ("recipe", "compiled"):
    p = os.path.join(rows_dir, name + ".json")
    if os.path.exists(p):
        rate[name] = json.load(open(p))["tokens_per_s"]
if mode == "auto":
    mode = "compiled" if rate.get("compiled", 0) >= 1.15 * rate.get("recipe", float("inf")) else "recipe"
tok_s = rate.get(mode, 200_000)  # without rows: the recipe's steady 212K tok/s per H200, rounded down
steps = int(0.85 * tok_s * total_min * 60 / 32768)  # the config's token budget per step
# the schedule spans both parts (PART=1 and its resume): sized here, not fitted to the first box
args = f"--run.fit_schedule false --run.max_steps {steps}" + (" --run.compile true" if mode == "compiled" else "")
print(args)
print(f"mode {mode} at {tok_s:,.0f} tok/s (rows: {rate}) -> {steps} steps in {total_min:g} min", file=sys.stderr)
PY
  cat $W/train_args.txt | tee -a $LOG
  TRAIN_MINUTES=${TRAIN_MINUTES:-7.5}
else
  [ -f $W/train_args.txt ] || { echo "FRESH MACHINE: run PART=1 first" | tee -a $LOG; exit 3; }
  rm -rf $W/train/final  # a time-boxed run ends with final/; the next one resumes the checkpoint
  TRAIN_MINUTES=${TRAIN_MINUTES:-4.5}
fi
STEPS=$([ "${PART:-1}" = 1 ] && echo "prepare train" || echo train)
stage train $(python3 -c "print(int($TRAIN_MINUTES * 60 + 150))") env TARGET=${TARGET:-/tmp/smol/hf} WORK=$W NGPU=$NGPU STEPS="$STEPS" \
  TRAIN_MINUTES=$TRAIN_MINUTES TRAIN_ARGS="$(cat $W/train_args.txt)" bash scripts/smollm2_recipe_x2.sh
cp $W/train/metrics.jsonl $OUT/metrics_part${PART:-1}.jsonl 2>/dev/null
grep -E "^==|^wrote|eval split|held-out @|eval @|stopped at|tok/s over|rc=|rror|Traceback" $LOG | grep -v "it/s\]" | tail -25
if [ "${PART:-1}" = 2 ] && [ "${EVAL:-1}" = 1 ]; then
  EVAL_SOURCE_PROMPTS=${EVAL_SOURCE_PROMPTS:-16} bash dev/device/recipe_eval.sh
fi
