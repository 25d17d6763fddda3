#!/usr/bin/env bash
# CPU rehearsal of the peer comparison, end to end, on a tiny random Llama (12 layers, hidden 32,
# the tests' ChatML tokenizer) and 50 synthetic conversations: train_peer.py in time mode and in
# tokens mode -> the peer's export -> convert.py -> `dflash-train eval`. Needs nvidia-modelopt and
# its few dependencies on PEER_SITE (docs/peer-comparison.md, "Installing the peer").
#
#   PEER_SITE=/path/to/site PY=.venv/bin/python bash bench/peer_modelopt/rehearse_cpu.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
W=${1:-/tmp/peer-rehearsal}
PY=${PY:-python3}
export PYTHONPATH=${PEER_SITE:?set PEER_SITE to the folder holding nvidia-modelopt}:$PWD/src
export HF_HUB_OFFLINE=1
rm -rf "$W" && mkdir -p "$W"
stamp() { echo "[$(date +%T)] $*"; }

stamp "tiny target + conversations in $W"
$PY - "$W" <<'EOF'
import json, sys
from pathlib import Path
sys.path.insert(0, "tests")
from conftest import build_target, build_tokenizer, synthetic_conversations
w = Path(sys.argv[1])
tok = build_tokenizer(w / "tiny")
build_target(w / "tiny", "llama", vocab=len(tok), layers=12)
rows = synthetic_conversations(60, seed=1)
(w / "train.jsonl").write_text("".join(json.dumps({"id": f"r{i}", **r}) + "\n" for i, r in enumerate(rows[:50])))
(w / "prompts.jsonl").write_text("".join(json.dumps({"messages": r["messages"][:1]}) + "\n" for r in rows[50:54]))
EOF

stamp "train_peer.py, time mode (0.3 min)"
$PY bench/peer_modelopt/train_peer.py --target "$W/tiny" --data "$W/train.jsonl" --output "$W/time" \
  --minutes 0.3 --seq-len 64 --batch-size 4 --num-anchors 16 --warmup-steps 5 --log-every 5
stamp "train_peer.py, tokens mode (3000 tokens)"
$PY bench/peer_modelopt/train_peer.py --target "$W/tiny" --data "$W/train.jsonl" --output "$W/tokens" \
  --tokens 3000 --seq-len 64 --batch-size 4 --num-anchors 16 --warmup-steps 5 --log-every 5

for mode in time tokens; do
  stamp "convert + eval ($mode)"
  $PY bench/peer_modelopt/convert.py "$W/$mode/export" "$W/$mode/drafter"
  $PY -m dflash_train eval --target "$W/tiny" --drafter "$W/$mode/drafter" --prompts "$W/prompts.jsonl" \
    --max-new-tokens 24 --greedy --device cpu --no-progress --output "$W/$mode/eval"
  $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print({k: r['overall'].get(k) for k in ('tau', 'speedup', 'divergences')})" \
    "$W/$mode/eval/report.json"
done
stamp "rehearsal done"
