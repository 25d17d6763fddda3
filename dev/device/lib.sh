# Shared by the device scripts (source it after setting LOG): `stage NAME LIMIT cmd...` runs a
# command under a time limit, its output appended to $LOG, with start/end/exit-code lines on
# stdout too (a silent stage that hits the run's time limit would otherwise return nothing).
stage() {  # returns the command's status; STAGES_FAILED counts the failed ones, for a loud exit
  local name=$1 limit=$2 rc; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  echo "=== $name rc=$rc $(date +%T)" | tee -a "$LOG"
  [ "$rc" = 0 ] || STAGES_FAILED=$((${STAGES_FAILED:-0} + 1))
  return "$rc"
}
# `stages_status`, a script's last line: exit status 1, and one line saying so, when a stage failed
stages_status() {
  [ "${STAGES_FAILED:-0}" = 0 ] || { echo "$(basename "$0"): ${STAGES_FAILED} stage(s) failed (their lines above; $LOG)" >&2; exit 1; }
}

# `smol_hf`: the built-in SmolLM2 target as a bf16 Hugging Face folder in /tmp/smol/hf, once per
# machine: the GGUF's two halves (part one left in /tmp/smol by recipe_prompts.sh or restore.sh,
# part two carried in .smol2) joined, checked and converted (~30 s). Needs gguf on PYTHONPATH.
smol_hf() {
  [ -f /tmp/smol/hf/model.safetensors ] && return 0
  cat /tmp/smol/part_aa .smol2/part_ab > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf | tee -a "$LOG"
  timeout 120 python3 dev/device/convert_smollm2.py /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol/hf >> "$LOG" 2>&1
}
