#!/usr/bin/env bash
# The packed compiled target forward alone (bench/profile_target.py, one 8,192-token row, target
# labels), A/B on one GPU host: new, old, new per preset, so the host's drift shows. Old is either a
# previous tree, carried as an untracked copy, or (LEVER=KEY=VALUE) this tree with a target setting:
#     mkdir ab_base && git archive <previous commit> src | tar -x -C ab_base
#     bash dev/device/target_ab.sh                   # old = ab_base/src
#     LEVER=grouped_kv=true bash dev/device/target_ab.sh   # old = this tree with --set grouped_kv=true
# $OUT/target_ab.log, <tag>-<preset>.json (tag new, old, new2). PRESETS="qwen3-30b-a3b gemma3-27b
# qwen3-8b" by default (~40 s a run on an H200: compile, warm-up, ITERS=5 timed); RUN_LIMIT 150 s a
# run. DRY=1: the plumbing on a CPU with the tiny preset.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/target_ab.log; mkdir -p "$OUT"
source dev/device/lib.sh
if [ -z "${LEVER:-}" ] && [ ! -d ab_base/src ]; then
  echo "no ab_base/src and no LEVER: the A/B needs the previous tree (see the header)" | tee -a "$LOG"; exit 2
fi
if [ "${DRY:-0}" = 1 ]; then
  PRESETS=${PRESETS:-tiny}; SET=(forward=packed); DEVICE=(--device cpu --tokens 256)
else
  PRESETS=${PRESETS:-qwen3-30b-a3b gemma3-27b qwen3-8b}; SET=(forward=packed compile=true); DEVICE=()
fi
for preset in $PRESETS; do
  for tag in new old new2; do
    src=$PWD/src; set_=("${SET[@]}")
    if [ $tag = old ]; then
      if [ -n "${LEVER:-}" ]; then set_+=("$LEVER"); else src=$PWD/ab_base/src; fi
    fi
    PYTHONPATH=$src PYTHONUNBUFFERED=1 stage "$tag-$preset" "${RUN_LIMIT:-150}" python3 bench/profile_target.py \
      --preset "$preset" --iters "${ITERS:-5}" --set "${set_[@]}" "${DEVICE[@]}" --out "$OUT/$tag-$preset.json"
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print(sys.argv[2], 'forward_ms_median', \
round(d['forward_ms_median'], 2))" "$OUT/$tag-$preset.json" "$tag-$preset" 2>/dev/null | tee -a "$LOG"
  done
done
stages_status
