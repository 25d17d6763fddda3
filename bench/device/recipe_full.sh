#!/usr/bin/env bash
# H200 (issue 17, one GPU): the recipe's full-length run on session 7's 73,640 conversations
# (carried as .recipe1/.recipe2), in three calls chained at once:
#   A  carry .smol1 .recipe1 .whl:  RESTORE=1 bash bench/device/restore.sh; the train-speed rows
#      (session7_train_speed.sh, ROWS_ORDER="compiled recipe") beside the prompt files (session5a.sh)
#   B  carry .smol2 .recipe2 .whl:  PART=1 bash bench/device/session8_train.sh   (~9.5 min)
#      restore, prepare, train TRAIN_MINUTES (7.5); the drafter mode and run.max_steps are chosen
#      here from call A's rows: compiled when it trains >= 15% faster, the schedule sized to
#      TOTAL_MINUTES of training (12) at the measured rate (x 0.85 for evals, saves, compiles)
#   C  carry .whl:                  PART=2 bash bench/device/session8_train.sh   (~10 min)
#      resume for the rest (TRAIN_MINUTES 4.5), then the measured eval (session5e.sh; EVAL=0 leaves
#      it to a call of its own: PART=3, the eval alone, for a resume that fills its call)
# The chosen arguments live in /tmp/recipe/train_args.txt so the resume uses the same ones. It
# counts the GPUs: on two, the recipe trains colocated (torchrun), each replica at the row's rate.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/session8.log; W=/tmp/recipe; mkdir -p $OUT
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
source bench/device/lib.sh
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
if [ "${PART:-1}" = 3 ]; then
  EVAL_SOURCE_PROMPTS=${EVAL_SOURCE_PROMPTS:-16} bash bench/device/session5e.sh; exit
fi
if [ "${PART:-1}" = 1 ]; then
  bash bench/device/restore.sh || exit 3
  python3 - /tmp/s7 "${TOTAL_MINUTES:-12}" "${MODE:-auto}" > $W/train_args.txt <<'PY'
import json, os, sys
rows_dir, total_min, mode = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rate = {}
for name in ("recipe", "compiled"):
    p = os.path.join(rows_dir, name + ".json")
    if os.path.exists(p):
        rate[name] = json.load(open(p))["tokens_per_s"]
if mode == "auto":
    mode = "compiled" if rate.get("compiled", 0) >= 1.15 * rate.get("recipe", float("inf")) else "recipe"
tok_s = rate.get(mode, 200_000)  # without rows: run 3's steady 212K tok/s per H200 (session 8), rounded down
steps = int(0.85 * tok_s * total_min * 60 / 32768)  # the config's token budget per step
# the schedule spans both parts (B and a resume in C): sized here, not fitted to B's box
args = f"--run.fit_schedule false --run.max_steps {steps}" + (" --run.compile true" if mode == "compiled" else "")
print(args)
print(f"mode {mode} at {tok_s:,.0f} tok/s (rows: {rate}) -> {steps} steps in {total_min:g} min", file=sys.stderr)
PY
  cat $W/train_args.txt | tee -a $LOG
  TRAIN_MINUTES=${TRAIN_MINUTES:-7.5}
else
  [ -f $W/train_args.txt ] || { echo "FRESH MACHINE: run A and B first" | tee -a $LOG; exit 3; }
  rm -rf $W/train/final  # a time-boxed session ends with final/; the next one resumes the checkpoint
  TRAIN_MINUTES=${TRAIN_MINUTES:-4.5}
fi
STEPS=$([ "${PART:-1}" = 1 ] && echo "prepare train" || echo train)
stage train $(python3 -c "print(int($TRAIN_MINUTES * 60 + 150))") env TARGET=/tmp/smol/hf WORK=$W NGPU=$NGPU STEPS="$STEPS" \
  TRAIN_MINUTES=$TRAIN_MINUTES TRAIN_ARGS="$(cat $W/train_args.txt)" bash scripts/smollm2_recipe_x2.sh
cp $W/train/metrics.jsonl $OUT/metrics8_part${PART:-1}.jsonl 2>/dev/null
grep -E "^==|^wrote|eval split|held-out @|eval @|stopped at|tok/s over|rc=|rror|Traceback" $LOG | grep -v "it/s\]" | tail -25
if [ "${PART:-1}" = 2 ] && [ "${EVAL:-1}" = 1 ]; then
  EVAL_SOURCE_PROMPTS=${EVAL_SOURCE_PROMPTS:-16} bash bench/device/session5e.sh
fi
