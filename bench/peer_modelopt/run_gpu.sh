#!/usr/bin/env bash
# The peer comparison on one GPU (docs/peer-comparison.md): Model-Optimizer's DFlash trainer on our
# training conversations, its drafter converted to our format and measured by `dflash-train eval`.
#
#   TARGET_HF=/tmp/smol/hf TRAIN_JSONL=/tmp/recipe/gen/train.jsonl OUT=/tmp/out \
#     MODE=time MINUTES=15 bash bench/peer_modelopt/run_gpu.sh
#   ... MODE=tokens TOKENS=60000000 bash bench/peer_modelopt/run_gpu.sh
#
# Run from the repository root. STAGES picks the stages (default: all, in this order):
#   install  requirements.txt into $SITE, /tmp/site by default, without dependencies (the machine's
#            torch stays); from the package index, or from WHEELS=DIR, a folder of those wheels
#   train    bench/peer_modelopt/train_peer.py -> $WORK/run (export in $WORK/run/export)
#   convert  bench/peer_modelopt/convert.py -> $WORK/drafter (our checkpoint)
#   humaneval, chat   dflash-train eval of $WORK/drafter (greedy, 256 new tokens)
# Stages after `train` can run later on the same machine (the work folder is kept in $WORK,
# /tmp/peer by default). Every stage runs under `timeout`; results and logs go to $OUT:
# peer_summary.json, peer_run.json, peer_export_config.json, peer_drafter_config.json,
# report_peer_humaneval.json, report_peer_chat.json, peer.log (everything the stages printed).
set -u
: "${TARGET_HF:?the target as a Hugging Face folder}" "${OUT:?results folder}"
MODE=${MODE:-time}
STAGES=${STAGES:-install train convert humaneval chat}
WORK=${WORK:-/tmp/peer}
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}              # where the wheels are installed
TRAIN_ARGS=${TRAIN_ARGS:-}          # extra train_peer.py flags (e.g. --batch-size 8 --seq-len 1024)
EVAL_PROMPTS=${EVAL_PROMPTS:-0}     # prompts per eval set (0 = all)
EVAL_LIMIT=${EVAL_LIMIT:-420}       # seconds per eval stage
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}  # one GPU (Trainer would wrap several in DataParallel)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
LOG=$OUT/peer.log
has() { [[ " $STAGES " == *" $1 "* ]]; }

# stage NAME LIMIT cmd...: timestamped start/end lines; the command's lines that start with a
# timestamp or carry a summary or an error are shown, everything goes to $LOG
stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG" \
    | grep --line-buffered -E '^\[[0-9:]{8}\]|SUMMARY|^error|Error|^converted|^tau|speedup|^output equals|^prompts '
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc $(date +%T)" | tee -a "$LOG"
  [ "$rc" = 0 ] || { echo "--- last lines of $name:"; tail -n 25 "$LOG"; }
  return "$rc"
}

if has install; then
  from=(-r bench/peer_modelopt/requirements.txt); [ -n "${WHEELS:-}" ] && from=(--no-index "$WHEELS"/*.whl)
  stage install 300 "$PY" -m pip install -q --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${from[@]}" || exit 1
fi
export PYTHONPATH=$SITE:$PWD/src${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH}

if has train; then
  : "${TRAIN_JSONL:?training conversations (gen/train.jsonl)}"
  case $MODE in
    time) : "${MINUTES:?MODE=time needs MINUTES}"; budget=(--minutes "$MINUTES")
          limit=$(awk "BEGIN {print int($MINUTES * 60 + 240)}") ;;
    tokens) : "${TOKENS:?MODE=tokens needs TOKENS}"; budget=(--tokens "$TOKENS"); limit=${TRAIN_LIMIT:-570} ;;
    *) echo "MODE must be time or tokens, got $MODE"; exit 2 ;;
  esac
  rm -rf "$WORK/run" "$WORK/drafter"
  (nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi") | tee -a "$LOG"
  stage train "$limit" "$PY" bench/peer_modelopt/train_peer.py --target "$TARGET_HF" --data "$TRAIN_JSONL" \
    --output "$WORK/run" "${budget[@]}" $TRAIN_ARGS || exit 1
  cp "$WORK/run/summary.json" "$OUT/peer_summary.json"
  cp "$WORK/run/export/peer_run.json" "$OUT/peer_run.json"
  cp "$WORK/run/export/config.json" "$OUT/peer_export_config.json"
fi

if has convert; then
  rm -rf "$WORK/drafter"
  stage convert 120 "$PY" bench/peer_modelopt/convert.py "$WORK/run/export" "$WORK/drafter" || exit 1
  cp "$WORK/drafter/config.json" "$OUT/peer_drafter_config.json"
fi

for set in humaneval chat; do
  has "$set" || continue
  stage "eval_$set" "$EVAL_LIMIT" "$PY" -m dflash_train eval --target "$TARGET_HF" --drafter "$WORK/drafter" \
    --prompts "$set" --num-prompts "$EVAL_PROMPTS" --max-new-tokens 256 --greedy --timing-repeats 1 --no-progress \
    --output "$WORK/eval-$set"
  cp "$WORK/eval-$set/report.json" "$OUT/report_peer_$set.json" 2>/dev/null
done
echo "=== done $(date +%T)"; ls -la "$OUT"
