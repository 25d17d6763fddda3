#!/usr/bin/env bash
# H200 session, call 1: correctness + throughput (issues 2, 4, 5, 6, 8).
# Run from the repo root on the device machine; results land in $OUT (2 files: session1.log,
# results1.json). Each stage has its own time limit, so one failure never costs the rest.
set -u
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; R=/tmp/results; mkdir -p $R $OUT
LOG=$OUT/session1.log
# part one of the SmolLM2 GGUF for call 2 (a warm machine keeps /tmp)
if [ -d .smol1 ]; then mkdir -p /tmp/smol && cp .smol1/part_aa /tmp/smol/ ; fi
stage() {
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s) $(date +%T)" | tee -a $LOG
  timeout --signal=TERM --kill-after=10 $limit "$@" >> $LOG 2>&1
  echo "=== $name rc=$? $(date +%T)" | tee -a $LOG
}
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv >> $LOG 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> $LOG 2>&1
stage flex_vs_dense 90 python3 bench/drafter_flex_vs_dense.py --out $R/flex_vs_dense.json
stage bench_qwen3_8b 130 python3 -m dflash_train bench --preset qwen3-8b --out $R/bench_qwen3_8b.json
stage smol_colocated1 50 python3 -m torch.distributed.run --nproc-per-node 1 --master-port 29601 -m dflash_train bench --preset smollm2-135m \
  --layout colocated --warmup 5 --measure 15 --out $R/bench_smol_colocated1.json
stage smol_split11 70 python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29602 -m dflash_train bench --preset smollm2-135m \
  --layout split --target-ranks 1 --drafter-ranks 1 --warmup 5 --measure 15 --out $R/bench_smol_split11.json
stage generate 90 python3 bench/bench_generate.py --random-init --slots 64,128,256 --compile off --out $R/generate.json
python3 - <<'PY' >> $LOG 2>&1
import glob, json, os
out = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob("/tmp/results/*.json"))}
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp/out"), "results1.json"), "w"), indent=1)
print("results:", list(out))
PY
grep -E "^===|^bench |tokens/s|FLOPs|achieved|time/step|peak memory|PASS|FAIL|bottleneck|new tok/s|error|Error" $LOG | tail -60
