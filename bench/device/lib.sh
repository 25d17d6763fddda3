# Shared by the device scripts (source it after setting LOG): `stage NAME LIMIT cmd...` runs a
# command under a time limit, its output appended to $LOG, with start/end/exit-code lines on
# stdout too (a silent stage that hits the call's limit would otherwise return nothing).
stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  echo "=== $name rc=$? $(date +%T)" | tee -a "$LOG"
}
