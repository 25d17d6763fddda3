#!/usr/bin/env bash
# H200 session 3, call A: the refactored trainer on the GPU path (issue 13: qwen3-8b preset,
# compiled, bf16 drafter; before the refactor 17.6K tok/s), and part one of the SmolLM2 GGUF
# for call B (a warm machine keeps /tmp). Results: $OUT/session3a.log, $OUT/results3a.json.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/results; mkdir -p $R $OUT
LOG=$OUT/session3a.log
if [ -d .smol1 ]; then mkdir -p /tmp/smol && cp .smol1/part_aa /tmp/smol/; fi
stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a $LOG
  timeout --signal=TERM --kill-after=10 $limit "$@" >> $LOG 2>&1
  echo "=== $name rc=$? $(date +%T)" | tee -a $LOG
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >> $LOG 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> $LOG 2>&1
stage bench_qwen3_8b_compiled 420 python3 -m dflash_train bench --preset qwen3-8b --compile --drafter-dtype bfloat16 \
  --out $R/bench_qwen3_8b_compiled.json
python3 - <<'PY' >> $LOG 2>&1
import glob, json, os
out = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/results/*.json"))}
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "results3a.json"), "w"), indent=1)
print("results:", list(out))
PY
grep -E "^===|^bench |tokens/s|achieved|time/step|peak memory|error|Error|Traceback" $LOG | tail -40
