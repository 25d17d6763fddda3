"""The demo's shipped data (`dflash_train/assets/`), and how it was made.

* `demo_train.jsonl`: conversations written by SmolLM2-135M-Instruct, greedy answers:
      dflash-train generate --synthesize 400 --seed 0 --output train.jsonl \\
          --max-new-tokens 256 --max-prompt-tokens 256 --batch-size 32
* `heldout_chat_prompts.jsonl`: user requests written by the same model with another seed
  (the answers are not kept: eval regenerates them):
      dflash-train generate --synthesize 130 --seed 1000 --output heldout.jsonl \\
          --max-new-tokens 1 --max-prompt-tokens 256 --batch-size 32
  then `python -m dflash_train.eval.assets train.jsonl heldout.jsonl` drops any held-out
  request that also occurs (case/whitespace-insensitively) in the training set, keeps 100,
  and writes both files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_train.data.prompts import CHAT_ASSET, asset_path
from dflash_train.utils.jsonl import read_json_rows

TRAIN_ASSET = "demo_train.jsonl"
HELDOUT_SIZE = 100


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


def user_turns(rows: list[dict]) -> set[str]:
    return {normalize(m["content"]) for r in rows for m in r.get("messages", []) if m["role"] == "user"}


def read_jsonl(path: Path) -> list[dict]:
    return [row for _, row in read_json_rows(path)]


def overlap(train_rows: list[dict], heldout_rows: list[dict]) -> set[str]:
    """Held-out requests that also occur in the training set (must be empty)."""
    held = {normalize(r["prompt"]) for r in heldout_rows}
    return held & user_turns(train_rows)


def build(train_jsonl: Path, heldout_jsonl: Path, out_dir: Path | None = None) -> tuple[int, int]:
    # the generator settings are the same for every row (see above): keep the conversation only
    train = [{"id": r["id"], "messages": r["messages"], "finish_reasons": r.get("finish_reasons")}
             for r in read_jsonl(train_jsonl) if r.get("messages")]
    train.sort(key=lambda r: r.get("id", ""))  # generate writes rows as they finish: make the file stable
    seen = user_turns(train)
    held: list[dict] = []
    for r in sorted(read_jsonl(heldout_jsonl), key=lambda r: int(str(r["id"]).rsplit("-", 1)[-1])):
        text = next(m["content"] for m in r["messages"] if m["role"] == "user")
        if normalize(text) in seen:
            continue
        seen.add(normalize(text))
        held.append({"id": f"chat-{len(held):03d}", "prompt": text, "source": r["id"]})
        if len(held) == HELDOUT_SIZE:
            break
    out_train = (out_dir / TRAIN_ASSET) if out_dir else asset_path(TRAIN_ASSET)
    out_held = (out_dir / CHAT_ASSET) if out_dir else asset_path(CHAT_ASSET)
    out_train.parent.mkdir(parents=True, exist_ok=True)
    out_train.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in train), encoding="utf-8")
    out_held.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in held), encoding="utf-8")
    return len(train), len(held)


if __name__ == "__main__":
    n_train, n_held = build(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"wrote {n_train} training conversations and {n_held} held-out prompts")
