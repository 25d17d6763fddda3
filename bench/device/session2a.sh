#!/usr/bin/env bash
# H200 session 2, call A: the throughput levers (issue 8) and the split layout after the
# credit fix (issue 5); stages part one of the SmolLM2 GGUF in /tmp/smol for call B.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/results2a; mkdir -p $R $OUT /tmp/smol
LOG=$OUT/session2a.log
[ -f .smol1/part_aa ] && cp .smol1/part_aa /tmp/smol/
stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a $LOG
  timeout --signal=TERM --kill-after=10 $limit "$@" >> $LOG 2>&1
  echo "=== $name rc=$? $(date +%T)" | tee -a $LOG
}
B="python3 -m dflash_train bench"
stage q8b_fp8_bf16 80 $B --preset qwen3-8b --drafter-dtype bfloat16 --fp8-target --warmup 3 --measure 6 --out $R/q8b_fp8_bf16.json
stage q8b_fp8_bf16_compiled 120 $B --preset qwen3-8b --drafter-dtype bfloat16 --fp8-target --compile --warmup 3 --measure 6 --out $R/q8b_fp8_bf16_compiled.json
stage d27b 90 $B --preset dense-27b --drafter-dtype bfloat16 --warmup 2 --measure 4 --out $R/d27b_bf16.json
stage smol_split11 50 python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29611 -m dflash_train bench \
  --preset smollm2-135m --layout split --target-ranks 1 --drafter-ranks 1 --warmup 5 --measure 15 --out $R/smol_split11.json
python3 - <<'PY' >> $LOG 2>&1
import glob, json, os
out = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/results2a/*.json"))}
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "results2a.json"), "w"), indent=1)
PY
ls -la /tmp/smol >> $LOG
grep -E "^===|^bench |tokens/s|FLOPs|achieved|time/step|peak memory|bottleneck|Error|error:" $LOG | tail -40
