"""What a target's chat template implies, found by rendering sentinel messages.

* `turn_end`: how an assistant turn ends: the special token the model writes to end it
  (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`, Phi-3's `<|end|>`; GLM's `<|user|>`, the
  next message's role token, since its template writes nothing after an answer) and what the
  template writes after a final answer (Phi-3: `<|end|>\n<|endoftext|>`);
* `end_of_turn_id`: that token's id;
* `stop_token_ids`: that, plus the EOS ids of the tokenizer and the generation config;
* `user_header`: the template rendered up to where a user message's text starts (the
  prefix from which the target writes a user turn itself, `generate --synthesize`).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_train.utils.errors import ModelError

SENTINEL = "\u2063dflash-sentinel\u2063"
_USER = {"role": "user", "content": "hi"}
_ANSWER = {"role": "assistant", "content": SENTINEL}


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _render_around_sentinel(tokenizer, messages: list[dict[str, str]],
                            chat_template: str | None = None) -> tuple[str, str] | None:
    """(text before, text after) the sentinel content in the rendered messages, or None."""
    extra = {"chat_template": chat_template} if chat_template else {}
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **extra)
    except Exception:  # noqa: BLE001 - a template that cannot render this simply has no answer
        return None
    if not isinstance(text, str) or SENTINEL not in text:
        return None
    i = text.index(SENTINEL)
    return text[:i], text[i + len(SENTINEL):]


def _first_special(tokenizer, text: str, anywhere: bool) -> str | None:
    """The first special token of `text` (`anywhere=False`: only if `text` starts with it)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
    special = set(getattr(tokenizer, "all_special_ids", [])) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    for i in ids if anywhere else ids[:1]:
        if i in special:
            return tokenizer.convert_ids_to_tokens(i)
    return None


@dataclass(frozen=True)
class TurnEnd:
    """How an assistant turn ends under a chat template."""

    token: str  # the special token the model writes to end its turn
    trailer: str  # what the template writes after the content of a final answer, `token` included if `written`
    written: bool  # False: the template leaves `token` to the next message (GLM), a final answer has none


def turn_end(tokenizer, chat_template: str | None = None) -> TurnEnd | None:
    """How `chat_template` (default: the tokenizer's) ends an assistant turn; None when it ends
    it with plain text or cannot render a one-turn conversation."""
    if not (chat_template or has_chat_template(tokenizer)):
        return None
    parts = _render_around_sentinel(tokenizer, [_USER, _ANSWER], chat_template)
    if parts is None:
        return None
    trailer = parts[1]
    token = _first_special(tokenizer, trailer, anywhere=True)
    if token is not None and token in trailer:
        return TurnEnd(token, trailer, True)
    if trailer.strip():  # the turn ends with plain text: no token to stop at
        return None
    # Nothing after the answer (GLM): the model stops by writing the role token that opens
    # the next message, which the template writes only once that message exists.
    parts = _render_around_sentinel(tokenizer, [_USER, _ANSWER, _USER], chat_template)
    token = _first_special(tokenizer, parts[1], anywhere=False) if parts else None
    return TurnEnd(token, trailer, False) if token is not None and parts[1].startswith(token) else None


def end_of_turn_id(tokenizer) -> int | None:
    end = turn_end(tokenizer)
    return None if end is None else tokenizer.convert_tokens_to_ids(end.token)


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
