#!/usr/bin/env bash
# H200 session 2, call B (right after A, machine still warm): the SmolLM2-135M recipe
# (issue 9) with real target-written data, time-boxed, plus the FP8 perturbation check.
set -u
OUT=${OUT:-/tmp/out}; LOG=$OUT/session2b.log; W=/tmp/smolrun; mkdir -p $W
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >> $LOG 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
if [ ! -f /tmp/smol/part_aa ]; then echo "FRESH MACHINE: /tmp/smol/part_aa missing" | tee -a $LOG; exit 3; fi
cat /tmp/smol/part_aa .smol2/part_ab > /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf | tee -a $LOG
# one slow GGUF load, then a plain Hugging Face directory that every later step loads fast
python3 - >> $LOG 2>&1 <<'PY'
import time, torch
t = time.time()
from dflash_train.target.loading import load_causal_lm, load_tokenizer
m = load_causal_lm("/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf", dtype=torch.bfloat16)
import json, os
from safetensors.torch import save_file
os.makedirs("/tmp/smol/hf", exist_ok=True)
cfg = m.config.to_dict(); cfg.pop("quantization_config", None); cfg["dtype"] = "bfloat16"
json.dump(cfg, open("/tmp/smol/hf/config.json", "w"))
sd = {k: v.contiguous() for k, v in m.state_dict().items() if not (k == "lm_head.weight" and m.config.tie_word_embeddings)}
save_file(sd, "/tmp/smol/hf/model.safetensors", metadata={"format": "pt"})
load_tokenizer("/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf").save_pretrained("/tmp/smol/hf")
print(f"converted in {time.time() - t:.1f}s")
PY
T=/tmp/smol/hf
TARGET=$T WORK=$W N_SYNTH=40000 MAX_NEW=384 SLOTS=256 GEN_LIMIT=${GEN_LIMIT:-75} TRAIN_MINUTES=${TRAIN_MINUTES:-1.8} \
  EVAL_PROMPTS=${EVAL_PROMPTS:-32} EVAL_NEW=128 TRAIN_ARGS="--run.max_steps 280 --optim.warmup_steps 30" timeout 300 bash scripts/smollm2_recipe.sh >> $LOG 2>&1
echo "recipe rc=$?" | tee -a $LOG
timeout 40 python3 bench/fp8_check.py --target $T --data $W/data --out $W/fp8_check.json >> $LOG 2>&1
python3 - >> $LOG 2>&1 <<'PY'
import glob, json, os, shutil
W, OUT = "/tmp/smolrun", os.environ.get("OUT", "/tmp/out")
res = {}
for p in glob.glob(f"{W}/eval-*/report.json") + [f"{W}/fp8_check.json", f"{W}/train/pipeline_stats.json"]:
    if os.path.exists(p):
        res[p.replace(W + "/", "")] = json.load(open(p))
rows = [json.loads(l) for l in open(f"{W}/train/metrics.jsonl")] if os.path.exists(f"{W}/train/metrics.jsonl") else []
res["train_metrics"] = rows[-40:]
res["synth_rows"] = sum(1 for _ in open(f"{W}/synth.jsonl")) if os.path.exists(f"{W}/synth.jsonl") else 0
if os.path.exists(f"{W}/data/manifest.json"):
    res["data_manifest_stats"] = {k: v for k, v in json.load(open(f"{W}/data/manifest.json")).items() if k in ("counts", "tokens")}
json.dump(res, open(f"{OUT}/results2b.json", "w"), indent=1, default=str)
for name in ("humaneval", "chat"):
    png = f"{W}/eval-{name}/report.png"
    if os.path.exists(png):
        shutil.copy(png, f"{OUT}/eval_{name}.png")
final = f"{W}/train/final"
if os.path.exists(f"{final}/model.safetensors"):
    shutil.copy(f"{final}/config.json", f"{OUT}/drafter_config.json")
    data = open(f"{final}/model.safetensors", "rb").read()
    for i in range(0, len(data), 15_000_000):
        open(f"{OUT}/drafter_part{i // 15_000_000}", "wb").write(data[i:i + 15_000_000])
print("packed", os.listdir(OUT))
PY
grep -E "^==|tau|speedup|equals|step [0-9]+/|eval @|conversations|converted|rc=|Error|error" $LOG | tail -45
