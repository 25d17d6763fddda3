"""Loss masks checked token by token against hand-built conversations, for two real templates."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_train.data.render import ChatRenderer, RenderError, TemplateError
from dflash_train.data.sources import DataError, parse_row

SYSTEM, USER1, USER2 = "You are terse.", "Hi there", "What is 2+2? Answer with one number."
ANSWER1, ANSWER2 = "Hello! How can I help? Ünïcödé 🤖 ok.", " 4\n"  # leading space, trailing newline

CONVERSATION = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": USER1},
    {"role": "assistant", "content": ANSWER1},
    {"role": "user", "content": USER2},
    {"role": "assistant", "content": ANSWER2},
]


def masked_runs(tok, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """Decode every maximal run of masked tokens."""
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def expected_from_pieces(tok, pieces: list[tuple[str, bool]]) -> tuple[list[int], list[bool]]:
    """Reference: tokenize each hand-written piece alone; the mask is True on the pieces
    marked True. The pieces split the text at points where the tokenizer splits anyway
    (checked by the caller against the tokenization of the whole text)."""
    ids, mask = [], []
    for text, on in pieces:
        piece = tok.backend_tokenizer.encode(text, add_special_tokens=False).ids
        ids += piece
        mask += [on] * len(piece)
    return ids, mask


def check(tok, renderer, messages, pieces, runs):
    ids, mask = renderer.encode_messages(messages)
    exp_ids, exp_mask = expected_from_pieces(tok, pieces)
    assert "".join(p for p, _ in pieces) == tok.decode(ids.tolist(), skip_special_tokens=False)
    assert ids.tolist() == exp_ids
    assert mask.tolist() == exp_mask  # token by token
    assert masked_runs(tok, ids, mask) == runs
    assert ids.dtype == np.int32 and mask.dtype == np.bool_


def test_chatml_smollm2(smol_tokenizer):
    tok = smol_tokenizer
    r = ChatRenderer(tok)
    pieces = [
        (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{USER1}<|im_end|>\n<|im_start|>assistant\n", False),
        (f"{ANSWER1}<|im_end|>", True),
        (f"\n<|im_start|>user\n{USER2}<|im_end|>\n<|im_start|>assistant\n", False),
        (f"{ANSWER2}<|im_end|>", True),
        ("\n", False),  # ChatML's separator after the end-of-turn token: never generated
    ]
    check(tok, r, CONVERSATION, pieces, [f"{ANSWER1}<|im_end|>", f"{ANSWER2}<|im_end|>"])


def test_chatml_injected_system_prompt_is_not_learned(smol_tokenizer):
    tok = smol_tokenizer
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    pieces = [
        (f"<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\n{USER1}<|im_end|>\n<|im_start|>assistant\n", False),
        (f"{ANSWER1}<|im_end|>", True),
        ("\n", False),
    ]
    # Messages after the last assistant turn carry no loss and are dropped.
    messages = CONVERSATION[1:3] + [{"role": "user", "content": "trailing question"}]
    check(tok, ChatRenderer(tok), messages, pieces, [f"{ANSWER1}<|im_end|>"])


def test_deepseek(deepseek_tokenizer):
    tok = deepseek_tokenizer
    bos, eos = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
    messages = [dict(m) for m in CONVERSATION]
    messages[2]["content"] = "<think>private reasoning</think>" + ANSWER1  # R1's template drops the reasoning
    pieces = [
        (f"{bos}{SYSTEM}<｜User｜>{USER1}<｜Assistant｜>", False),
        (f"{ANSWER1}{eos}", True),
        (f"<｜User｜>{USER2}<｜Assistant｜>", False),
        (f"{ANSWER2}{eos}", True),
    ]
    check(tok, ChatRenderer(tok), messages, pieces, [f"{ANSWER1}{eos}", f"{ANSWER2}{eos}"])


def test_prompt_response_and_text_rows(smol_tokenizer):
    tok = smol_tokenizer
    r = ChatRenderer(tok)
    rec = parse_row({"prompt": "Name a color.", "response": "Blue."}, "f.jsonl", 3)
    ids, mask = r.encode_record(rec)
    assert masked_runs(tok, ids, mask) == ["Blue.<|im_end|>"]

    rec = parse_row({"text": "Just some text."}, "f.jsonl", 4)
    ids, mask = r.encode_record(rec)
    assert ids.tolist() == tok.backend_tokenizer.encode("Just some text.").ids
    assert mask.all()
    ids_eos, mask_eos = ChatRenderer(tok, text_eos=True).encode_record(rec)
    assert ids_eos.tolist() == ids.tolist() + [tok.eos_token_id] and mask_eos.all()


def test_template_that_rejects_system_names_the_row(smol_tokenizer):
    template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<{{ m['role'] }}>{{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    r = ChatRenderer(smol_tokenizer, chat_template=template)
    with pytest.raises(RenderError, match="System role not supported"):
        r.encode_messages(CONVERSATION)
    rec = parse_row({"messages": CONVERSATION}, "chats.jsonl", 7)
    with pytest.raises(DataError, match=r"chats.jsonl:7: field 'messages'.*System role not supported"):
        r.encode_record(rec)
    ids, mask = r.encode_messages(CONVERSATION[1:])  # without the system message it works
    assert masked_runs(smol_tokenizer, ids, mask) == [f"{ANSWER1}<|im_end|>", f"{ANSWER2}<|im_end|>"]


def test_template_that_rerenders_history_is_refused(smol_tokenizer):
    # Drops the content of every assistant turn but the last, like templates that strip old reasoning.
    template = (
        "{% for m in messages %}<{{ m['role'] }}>"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    r = ChatRenderer(smol_tokenizer, chat_template=template)
    with pytest.raises(RenderError, match=r"messages\[2\].*differently once the conversation goes on"):
        r.encode_messages(CONVERSATION)


def test_bad_conversations(smol_tokenizer):
    r = ChatRenderer(smol_tokenizer)
    with pytest.raises(RenderError, match=r"messages\[0\].*must not open with an assistant turn"):
        r.encode_messages([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}])
    tok = smol_tokenizer
    saved = tok.chat_template
    try:
        tok.chat_template = None
        with pytest.raises(TemplateError, match="no chat template"):
            ChatRenderer(tok).encode_messages(CONVERSATION)
    finally:
        tok.chat_template = saved
