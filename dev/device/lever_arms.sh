#!/usr/bin/env bash
# Levers side by side on one GPU: several training arms run at once, each pinned to its own
# share of the CPU cores, for the same wall-clock minutes, then every arm's drafter is measured by
# speculative decoding (dev/README.md, "The recipe's results: the commands"). The GPU time-slices
# between the arms, so each gets about the same GPU-minutes, and a control arm (the base recipe)
# runs under the very conditions the levers do: a cleaner A/B than a lever against a run of an
# earlier machine, for 1/N of the GPU each (a small model's step leaves the GPU partly idle, so N
# arms see more tokens in all than one alone).
#
# A wrapper of quality_side_by_side.sh (its setup, stash and data parts first, on the same warm
# machine; every arm is one of its detached `ours` runs, on $W/data unless its args say otherwise):
#   STEP=start  ARMS (one arm a line: NAME ARGS...), COMMON (args every arm gets), TRAIN_MINUTES:
#               start the arms, arm i on cores i*C..i*C+C-1 (C = the cores / the arms)  (~5 s)
#   STEP=wait   follow the arms up to WAIT_SECONDS (default 540): each arm's state (running, or
#               ended with its exit status), last step line, first-step memory line, and the
#               GPU's memory; an arm whose log holds a traceback sends the whole log back to $OUT;
#               exit 0 either way, call again. THEN_EVAL=1: once every arm has ended, STEP=eval
#               at once in the same call (the GPU host goes back 30 s after a call: trained arms
#               left waiting for the next call are lost with it)
#   STEP=eval   once every arm has ended: each arm's tau-only evals (EVAL_SLOTS, default 16:
#               HumanEval, chat, held-out and training source prompts) at once, one process an
#               arm; then BATCH1_ARMS (names) one after another at batch 1 with plain greedy
#               beside them (HumanEval: the speedup, the GPU to itself); the results packed in
#               $OUT/arms-results.tar.xz and each arm's summary printed
#
#   STEP=start ARMS=$'base\nwsd --optim.schedule wsd' COMMON="--drafter.init_from ..." \
#     TRAIN_MINUTES=12 bash dev/device/lever_arms.sh
set -u
STEP=${STEP:?STEP=start|wait|eval}
OUT=${OUT:-/tmp/out}; W=/tmp/recipe; mkdir -p "$OUT"
LOG=$OUT/arms_$STEP.log
QSS=dev/device/quality_side_by_side.sh
source dev/device/lib.sh

arm_names() { cut -d' ' -f1 $W/arms; }  # the arms STEP=start started on this machine
if [ "$STEP" != start ]; then
  [ -s $W/arms ] || { echo "no arms started on this machine (STEP=start first)" >&2; exit 3; }
  for name in $(arm_names); do
    [ -f "$W/$name.pid" ] || { echo "arm $name was not started on this machine (STEP=start first)" >&2; exit 3; }
  done
fi

eval_arms() {  # STEP=eval
  for name in $(arm_names); do
    kill -0 "$(cat $W/$name.pid)" 2>/dev/null && { echo "arm $name still running: STEP=wait first" >&2; exit 3; }
  done
  pids=()
  for name in $(arm_names); do  # tau only: batched decoding, so the arms' evals may share the GPU
    env GREEDY=0 EVAL_SLOTS=${EVAL_SLOTS:-16} WAIT_SECONDS=1 PART=wait OURS_NAME="$name" bash $QSS > "$W/$name.eval.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p"; done
  for name in ${BATCH1_ARMS:-}; do  # batch 1 beside plain greedy: timed, so one at a time
    mkdir -p /tmp/drafter-kept && ln -sfn "$W/$name/final" "/tmp/drafter-kept/$name-batch1"
    env SETS=humaneval SOURCE_SETS=0 GREEDY=1 TIMING_REPEATS=1 PART=eval EVAL_NAME="$name-batch1" bash $QSS >> "$LOG" 2>&1
  done
  for name in $(arm_names); do
    echo "--- $name"; grep -E "^steps [0-9]|tau by speculative decoding" "$W/$name.train.log" | tail -2 | cut -c1-200
    python3 scripts/recipe_eval_summary.py "$W/eval-$name"
  done | tee -a "$LOG"
  for name in $(arm_names); do cp "$W/$name.train.log" "$OUT/$name.train.log"; done
  # a call brings back 8 files: every arm's reports, metrics and logs (training's too) in one
  (cd "$OUT" && ls | grep -v -E '^arms' > /tmp/arms-files && tar -cJf /tmp/arms-results.tar.xz -T /tmp/arms-files \
     && mv /tmp/arms-results.tar.xz . && xargs rm -f < /tmp/arms-files)
  ls -l "$OUT"
}

case $STEP in
start)
  : "${ARMS:?ARMS: one arm a line, NAME ARGS...}"
  printf '%s\n' "$ARMS" | sed '/^[[:space:]]*$/d' > $W/arms.new
  n=$(wc -l < $W/arms.new); cores=$(nproc); per=$((cores / n))
  [ "$per" -ge 1 ] || { echo "$n arms on $cores cores: fewer arms" >&2; exit 2; }
  mv $W/arms.new $W/arms
  i=0
  while read -r name args; do
    first=$((i * per)); last=$((first + per - 1))
    echo "=== arm $name on cores $first-$last: ${COMMON:-} $args $(date +%T)" | tee -a "$LOG"
    taskset -c "$first-$last" env DETACH=1 PART=ours OURS_NAME="$name" OURS_ARGS="${COMMON:-} $args" \
      bash $QSS >> "$LOG" 2>&1 < /dev/null || { echo "arm $name did not start" | tee -a "$LOG"; exit 1; }
    i=$((i + 1))
  done < $W/arms ;;
wait)
  deadline=$((SECONDS + ${WAIT_SECONDS:-540}))
  while :; do
    running=0
    for name in $(arm_names); do kill -0 "$(cat $W/$name.pid)" 2>/dev/null && running=$((running + 1)); done
    [ "$running" = 0 ] || [ $SECONDS -ge $deadline ] && break
    sleep 30
  done
  for name in $(arm_names); do
    state="ended rc=$(cat "$W/$name.rc" 2>/dev/null || echo '?')"; kill -0 "$(cat $W/$name.pid)" 2>/dev/null && state=running
    if grep -q Traceback "$W/$name.train.log"; then  # its whole log comes back: where it failed, and what it did after
      cp "$W/$name.train.log" "$OUT/$name.train.log"; state="$state; a traceback: \$OUT/$name.train.log"
    fi
    echo "--- $name ($state): $(grep -E '^first step done' $W/$name.train.log | head -1 | cut -c1-120)"
    grep -E "^step|held-out|stopped at|Traceback|rror" $W/$name.train.log | tail -2 | cut -c1-200
  done | tee -a "$LOG"
  nvidia-smi --query-gpu=memory.used,memory.total,utilization.gpu --format=csv,noheader | tee -a "$LOG"
  echo "$running arm(s) running $(date +%T)" | tee -a "$LOG"
  if [ "$running" = 0 ] && [ "${THEN_EVAL:-0}" = 1 ]; then LOG=$OUT/arms_eval.log; eval_arms; fi ;;
eval) eval_arms ;;
*) echo "STEP=start|wait|eval" >&2; exit 2 ;;
esac
