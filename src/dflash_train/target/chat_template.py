"""What a target's chat template implies, found by rendering sentinel messages.

* `end_of_turn_id`: the special token the template puts after an assistant message
  (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`);
* `stop_token_ids`: that, plus the EOS ids of the tokenizer and the generation config;
* `user_header`: the template rendered up to where a user message's text starts (the
  prefix from which the target writes a user turn itself, `generate --synthesize`).
"""

from __future__ import annotations

from dflash_train.utils.errors import ModelError

SENTINEL = "\u2063dflash-sentinel\u2063"


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render_around_sentinel(tokenizer, messages: list[dict[str, str]]) -> tuple[str, str] | None:
    """(text before, text after) the sentinel content in the rendered messages, or None."""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this simply has no answer
        return None
    if SENTINEL not in text:
        return None
    i = text.index(SENTINEL)
    return text[:i], text[i + len(SENTINEL):]


def end_of_turn_id(tokenizer) -> int | None:
    if not has_chat_template(tokenizer):
        return None
    parts = _render_around_sentinel(tokenizer, [{"role": "user", "content": "hi"},
                                                {"role": "assistant", "content": SENTINEL}])
    after = parts[1] if parts else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after.strip() else []
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    return ids[0] if ids and ids[0] in special else None


def stop_token_ids(tokenizer, model) -> set[int]:
    """EOS ids of the tokenizer and the model's generation config, plus the chat end-of-turn."""
    ids = set(_as_id_list(getattr(tokenizer, "eos_token_id", None)))
    gen_cfg = getattr(model, "generation_config", None)
    ids |= set(_as_id_list(getattr(gen_cfg, "eos_token_id", None)))
    eot = end_of_turn_id(tokenizer)
    if eot is not None:
        ids.add(eot)
    return ids


def user_header(tokenizer, system_prompt: str | None = None) -> str:
    if not has_chat_template(tokenizer):
        raise ModelError("the target's tokenizer has no chat template: cannot synthesise conversations")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": SENTINEL}]
    parts = _render_around_sentinel(tokenizer, messages)
    if parts is None:
        raise ModelError("the chat template does not render the user message verbatim: cannot synthesise")
    return parts[0]


def special_strings(tokenizer) -> list[str]:
    """The tokenizer's special and added token strings (longer than one character)."""
    if tokenizer is None:
        return []
    tokens = set(getattr(tokenizer, "all_special_tokens", []) or [])
    tokens |= {str(t) for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()}
    return sorted(t for t in tokens if len(t) > 1)
