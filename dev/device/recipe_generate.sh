#!/usr/bin/env bash
# The SmolLM2 recipe, step 2: generation (`dflash-train generate` through scripts/smollm2_recipe_x2.sh,
# one process per GPU on disjoint prompt shards plus self-instructed chats) for GEN_LIMIT s (default
# 420), SLOTS (default 768) sequences per GPU, GEN_ATTENTION (auto|dense|flex); the new tokens/s per
# GPU from each run's summary (registry generate.smollm2.*). After recipe_prompts.sh on the same
# machine; one or two H200s, ~8.5 min:
#     bash dev/device/recipe_generate.sh
#     PROBES="dense:256 flex:256 flex:768" PROBE_SECONDS=110 GEN_LIMIT=100 bash dev/device/recipe_generate.sh
# PROBES: each ATTENTION:SLOTS a PROBE_SECONDS generation into the same files (the data is kept),
# then the main run (GEN_LIMIT s; 0 = probes only) with the fastest. Resumable: a second run adds
# more (finished rows are skipped). The conversations come back as xz parts under $OUT/recipe/
# (EXPORT=0 skips), to be carried to a later machine (recipe_prompts.sh RECIPE_FROM, restore.sh).
# Results in $OUT: recipe_generate.log, gen-<k>.log (each ends with its summary).
set -u
NGPU=$( (nvidia-smi -L 2>/dev/null || true) | wc -l); [ "$NGPU" -ge 1 ] || NGPU=1
OUT=${OUT:-/tmp/out}; LOG=$OUT/recipe_generate.log; W=/tmp/recipe; mkdir -p $OUT
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >> $LOG 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
TARGET=${TARGET:-/tmp/smol/hf}  # a Hugging Face folder; default: the built-in SmolLM2 converted by lib.sh smol_hf
if [ ! -f $W/prompts/manifest.json ]; then echo "FRESH MACHINE: run recipe_prompts.sh first" | tee -a $LOG; exit 3; fi
source dev/device/lib.sh
[ "$TARGET" = /tmp/smol/hf ] && smol_hf
gen() {  # SECONDS ATTENTION SLOTS: generation (resumes the same files), then its summary's rates
  echo "=== generate ${1}s, $2 attention, $3 slots $(date +%T)" | tee -a $LOG
  TARGET=$TARGET WORK=$W NGPU=$NGPU STEPS=generate GEN_LIMIT=$1 GEN_ATTENTION=$2 SLOTS=$3 MAX_NEW=${MAX_NEW:-512} \
    N_SYNTH=${N_SYNTH:-100000} bash scripts/smollm2_recipe_x2.sh >> $LOG 2>&1
  echo "=== generate rc=$? $(date +%T)" | tee -a $LOG
  python3 - $W/gen/gen-0.log "$2:$3" <<'PY' | tee -a $LOG
import json, re, sys
text = open(sys.argv[1]).read()
m = re.search(r"^\{\n.*?^\}", text, re.S | re.M)  # the summary JSON printed at the end
if not m:
    print("probe", sys.argv[2], "no summary"); sys.exit()
s = json.loads(m.group(0)); e = s.get("engine_stats", {})
print("probe", sys.argv[2], "new_tok_s", s["new_tokens_per_second"], "kept_tok_s", s.get("kept_tokens_per_second"),
      "written", s["written"], "stopped_by", s["stopped_by"],
      "ms_per_step", e.get("ms_per_decode_step"), "util", e.get("slot_utilisation"), "prefill_s", e.get("prefill_seconds"),
      "decode_s", e.get("decode_seconds"))
PY
}
# PROBES="dense:256 flex:256 flex:768": each a PROBE_SECONDS generation into the same files (the
# data is kept), to measure the engine settings on the recipe's real prompts; the main run
# then uses the fastest (GEN_LIMIT s; 0 = probes only).
best=${GEN_ATTENTION:-flex}:${SLOTS:-768}; best_rate=0
for p in ${PROBES:-}; do
  gen ${PROBE_SECONDS:-90} ${p%%:*} ${p##*:}
  rate=$(grep "^probe $p " $LOG | tail -1 | awk '{print $4}')
  if python3 -c "import sys; sys.exit(0 if float('${rate:-0}' or 0) > float('$best_rate') else 1)" 2>/dev/null; then best=$p; best_rate=$rate; fi
done
[ "${GEN_LIMIT:-420}" -gt 0 ] && gen ${GEN_LIMIT:-420} ${best%%:*} ${best##*:}
wc -l $W/gen/gen-*.jsonl | tee -a $LOG
for f in $W/gen/gen-*.log; do tail -c 20000 $f > $OUT/$(basename $f); done  # the summary: written, new tok/s
grep -E "^===|written|new_tokens|stopped|rror|Traceback" $LOG $W/gen/gen-*.log | tail -20
# The generated conversations come back (xz, 15 MB parts under $OUT/recipe/): a later machine
# takes them (git-ignored .recipe/, RECIPE_FROM=.recipe in recipe_prompts.sh), and its generation
# adds to them (the prompt files are rebuilt identically on the same machine image: finished rows skip).
if [ "${EXPORT:-1}" = 1 ]; then
  mkdir -p $OUT/recipe
  (cd $W && tar -cf - gen/gen-*.jsonl) | xz -T0 -6 | split -b 15000000 - $OUT/recipe/recipe.tar.xz.part_
  ls -la $OUT/recipe | tee -a $LOG
fi
