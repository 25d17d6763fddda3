#!/usr/bin/env bash
# The peer's whole chain on one GPU before a real run (~2 min): a random target of SmolLM2-135M's
# shape (30 layers, hidden 576, vocabulary 49,152; the tests' ChatML tokenizer) and 400 synthetic
# conversations of 300-1,400 tokens, as long as the recipe's longest rows: the peer installs
# (requirements.txt, from the package index or from WHEELS=DIR as in run_gpu.sh),
# train_peer.py trains for SMOKE_MINUTES (0.5) with TRAIN_ARGS, its export is converted, and
# `dflash-train eval` decodes 8 prompts with it. Prints the peer's tokens/s and the GPU's peak
# memory, so a real run's settings (rows, anchors) are known to fit.
#
#   export OUT; TRAIN_ARGS="--seq-len 1536 --batch-size 8" bash bench/peer_modelopt/smoke_gpu.sh
set -u
OUT=${OUT:-/tmp/out}; W=/tmp/peer-smoke; LOG=$OUT/peer_smoke.log; mkdir -p "$OUT"; rm -rf "$W"; mkdir -p "$W"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
from=(-r bench/peer_modelopt/requirements.txt); [ -n "${WHEELS:-}" ] && from=(--no-index "$WHEELS"/*.whl)
python3 -m pip install -q --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${from[@]}" \
  >> "$LOG" 2>&1 || { echo "the peer did not install: $LOG"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/src
stamp() { echo "[$(date +%T)] $*" | tee -a "$LOG"; }

stamp "random SmolLM2-shaped target + 400 long conversations in $W"
python3 - "$W" <<'EOF' >> "$LOG" 2>&1
import json, random, sys
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
sys.path.insert(0, "tests")
from conftest import WORDS, build_tokenizer
w = Path(sys.argv[1])
build_tokenizer(w / "target")
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
                  rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(w / "target"), safe_serialization=True)
rng = random.Random(0)
with open(w / "train.jsonl", "w") as f:
    for i in range(400):
        ask = f"say {rng.choice(WORDS)} many times"
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randrange(300, 1400)))
        f.write(json.dumps({"id": f"s{i}", "messages": [{"role": "user", "content": ask},
                                                       {"role": "assistant", "content": answer}]}) + "\n")
with open(w / "prompts.jsonl", "w") as f:
    for i in range(8):
        f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"say {WORDS[i]} many times"}]}) + "\n")
EOF
[ -f "$W/target/model.safetensors" ] || { echo "target not built: $LOG"; tail -20 "$LOG"; exit 1; }

stamp "train_peer.py ${SMOKE_MINUTES:-0.5} min ${TRAIN_ARGS:-}"
timeout 300 python3 bench/peer_modelopt/train_peer.py --target "$W/target" --data "$W/train.jsonl" --output "$W/run" \
  --minutes "${SMOKE_MINUTES:-0.5}" --log-every 10 ${TRAIN_ARGS:-} >> "$LOG" 2>&1
stamp "train rc=$?"; grep -E "SUMMARY|rror|memory" "$LOG" | tail -5
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader | tee -a "$LOG"

stamp "convert + eval"
timeout 60 python3 bench/peer_modelopt/convert.py "$W/run/export" "$W/drafter" >> "$LOG" 2>&1
timeout 180 python3 -m dflash_train eval --target "$W/target" --drafter "$W/drafter" --prompts "$W/prompts.jsonl" \
  --max-new-tokens 64 --no-progress --output "$W/eval" >> "$LOG" 2>&1
stamp "eval rc=$?"; grep -E "^tau|equals|rror" "$LOG" | tail -4
cp "$W/run/summary.json" "$OUT/peer_smoke_summary.json" 2>/dev/null; true
