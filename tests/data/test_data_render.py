"""Loss masks checked token by token against hand-built conversations, for two real templates."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_train.data.render import ChatRenderer, RenderError, TemplateError
from dflash_train.data.sources import parse_row
from dflash_train.utils.errors import DataError

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
    [(ids, mask)] = renderer.encode_messages(messages)
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
    [(ids, mask)] = r.encode_record(rec)
    assert masked_runs(tok, ids, mask) == ["Blue.<|im_end|>"]

    rec = parse_row({"text": "Just some text."}, "f.jsonl", 4)
    [(ids, mask)] = r.encode_record(rec)
    assert ids.tolist() == tok.backend_tokenizer.encode("Just some text.").ids
    assert mask.all()
    [(ids_eos, mask_eos)] = ChatRenderer(tok, text_eos=True).encode_record(rec)
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
    [(ids, mask)] = r.encode_messages(CONVERSATION[1:])  # without the system message it works
    assert masked_runs(smol_tokenizer, ids, mask) == [f"{ANSWER1}<|im_end|>", f"{ANSWER2}<|im_end|>"]


def test_template_that_rerenders_history_gives_one_row_per_assistant_turn(smol_tokenizer):
    # Drops the content of every assistant turn but the last, like templates that strip old reasoning (Qwen3).
    template = (
        "{% for m in messages %}<{{ m['role'] }}>"
        "{% if m['role'] != 'assistant' or loop.last %}{{ m['content'] }}{% endif %}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<{{ 'assistant' }}>{% endif %}"
    )
    tok = smol_tokenizer
    r = ChatRenderer(tok, chat_template=template)
    rows = r.encode_messages(CONVERSATION)
    assert len(rows) == 2
    (ids1, mask1), (ids2, mask2) = rows
    # each row: the conversation up to that turn as the model sees it then, loss on that turn only
    assert tok.decode(ids1.tolist()) == (f"<system>{SYSTEM}<|im_end|><user>{USER1}<|im_end|>"
                                         f"<assistant>{ANSWER1}<|im_end|>")
    assert masked_runs(tok, ids1, mask1) == [f"{ANSWER1}<|im_end|>"]
    assert tok.decode(ids2.tolist()) == (f"<system>{SYSTEM}<|im_end|><user>{USER1}<|im_end|><assistant><|im_end|>"
                                         f"<user>{USER2}<|im_end|><assistant>{ANSWER2}<|im_end|>")
    assert masked_runs(tok, ids2, mask2) == [f"{ANSWER2}<|im_end|>"]
    out = r.encode_records([parse_row({"messages": CONVERSATION}, "f.jsonl", 1)])
    assert [[a.tolist() for a in row] for row in out[0]] == [[ids1.tolist(), mask1.tolist()],
                                                            [ids2.tolist(), mask2.tolist()]]


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


def random_conversations(seed: int, n: int) -> list[list[dict[str, str]]]:
    rng = np.random.default_rng(seed)
    alphabet = list("abc xyz ,.!?\n\t") + ["é", "ß", "漢字", "🤖", "  ", "<|im_end|>", "<｜User｜>", "<think>", "\u200b"]
    def text():
        return "".join(rng.choice(alphabet, int(rng.integers(0, 30))))
    convs = []
    for _ in range(n):
        msgs = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for _ in range(int(rng.integers(1, 4))):
            msgs += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        convs.append(msgs)
    return convs


@pytest.mark.parametrize("which", ["smol_tokenizer", "deepseek_tokenizer"])
def test_byte_length_fast_path_equals_offsets(which, request):
    """The cumulative-byte-length fast path must give exactly what character offsets give,
    including multi-byte characters and special-token text inside messages."""
    tok = request.getfixturevalue(which)
    fast = ChatRenderer(tok)
    assert fast._byte_len is not None  # both are byte-level BPE
    slow = ChatRenderer(tok)
    slow._byte_len = None
    broken = ChatRenderer(tok)  # wrong table: every row must fail the byte check and fall back
    broken._byte_len = fast._byte_len + 1
    convs = random_conversations(0, 60) + [CONVERSATION]
    rendered = [row for m in convs for row in fast.assistant_spans(m)]
    for a, b, c in zip(fast._encode_rendered(rendered), slow._encode_rendered(rendered), broken._encode_rendered(rendered)):
        assert a[0].tolist() == b[0].tolist() == c[0].tolist()
        assert a[1].tolist() == b[1].tolist() == c[1].tolist()


def test_encode_records_keeps_order_and_returns_bad_rows(smol_tokenizer):
    r = ChatRenderer(smol_tokenizer)
    rows = [parse_row({"messages": CONVERSATION}, "f.jsonl", 1), parse_row({"text": "hello"}, "f.jsonl", 2),
            parse_row({"messages": [{"role": "assistant", "content": "x"}]}, "f.jsonl", 3),
            parse_row({"prompt": "a", "response": "b"}, "f.jsonl", 4)]
    out = r.encode_records(rows)
    assert isinstance(out[2], DataError) and out[2].line == 3
    for k in (0, 1, 3):
        [(ids, mask)] = r.encode_record(rows[k])
        assert len(out[k]) == 1 and out[k][0][0].tolist() == ids.tolist() and out[k][0][1].tolist() == mask.tolist()
