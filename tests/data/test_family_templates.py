"""Loss masks and stop tokens under every family's real chat template (tests/family_templates.py).

The expectation is written here from what each template is known to do (what the model writes
after the generation prompt, which token ends its turn, which templates re-render history), not
from ChatRenderer's algorithm: each answer's span is found in the rendered text by its own text,
and the mask is checked token by token through `prepare` and the dataset it writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_train.data.dataset import TokenDataset
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.data.render import ChatRenderer
from dflash_train.target.chat_template import end_of_turn_id, stop_token_ids
from tests.families import FAMILIES
from tests.family_templates import SPECS, TEMPLATES, build_tokenizer

SYSTEM = "You are a terse assistant."
USERS = ["Hi there, who are you?", "What is 2+2?", "Name a fruit."]
ANSWERS = ["I am a small model.", "It is 4, of course.", "Café au lait ☕ is no fruit; a pear is."]


@dataclass(frozen=True)
class Writes:
    """What the model writes for one answer under a template, around the answer's text."""

    header: str  # before the text: its part of the assistant header, an empty reasoning block
    stop: str  # the token that ends its turn (the last one it writes)
    after: str  # what the template writes after `stop` when the answer ends the conversation
    eos: str  # the tokenizer's eos


WRITES = {
    "llama3": Writes("", "<|eot_id|>", "", "<|eot_id|>"),
    "mistral": Writes(" ", "</s>", "", "</s>"),  # the space after [/INST] is the model's
    "chatml": Writes("", "<|im_end|>", "\n", "<|im_end|>"),
    "qwen3": Writes("<think>\n\n</think>\n\n", "<|im_end|>", "\n", "<|im_end|>"),
    "qwen3_5": Writes("\n</think>\n\n", "<|im_end|>", "\n", "<|im_end|>"),  # the prompt opens <think>
    "gemma": Writes("", "<end_of_turn>", "\n", "<eos>"),
    "phi3": Writes("", "<|end|>", "\n<|endoftext|>", "<|endoftext|>"),  # eos after <|end|>: never written
    "gpt_oss": Writes("<|channel|>final<|message|>", "<|return|>", "", "<|return|>"),
    "deepseek_v3": Writes("", "<｜end▁of▁sentence｜>", "", "<｜end▁of▁sentence｜>"),
    "glm4_moe": Writes("\n<think></think>\n", "<|user|>", "", "<|endoftext|>"),  # stops at the next role token
    "olmo2": Writes("", "<|endoftext|>", "", "<|endoftext|>"),
}
# Templates that render an old answer differently from a final one: Qwen3/3.5 drop its <think>
# block, gpt-oss ends it with <|end|> instead of <|return|>. Each answer is then a row of its own.
RERENDERS = {"qwen3", "qwen3_5", "gpt_oss"}


def conversation(turns: int, system: bool) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}] if system else []
    for user, answer in zip(USERS[:turns], ANSWERS[:turns]):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return messages


CONVERSATIONS = [conversation(turns, system) for system in (False, True) for turns in (1, 2, 3)]


def expected_rows(tok, key: str, messages: list[dict[str, str]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """(text, character spans of the model's tokens) of each row the conversation must give."""
    w = WRITES[key]
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    writes = [w.header + messages[i]["content"] + w.stop for i in answers]
    # Mistral puts the system message on the open user turn only: each answer sees it there.
    per_turn = (key in RERENDERS and len(answers) > 1) or (key == "mistral" and messages[0]["role"] == "system")
    if per_turn:
        rows = []
        for i, written in zip(answers, writes):
            prompt = tok.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            rows.append((prompt + written + w.after, [(len(prompt), len(prompt) + len(written))]))
        return rows
    text = tok.apply_chat_template(messages, tokenize=False)
    if key == "glm4_moe":  # the template leaves the final stop token to a next message
        text += w.stop
    assert text.endswith(writes[-1] + w.after)
    spans, at = [], 0
    for written in writes:
        at = text.index(written, at)
        spans.append((at, at + len(written)))
        at += len(written)
    return [(text, spans)]


def expected_ids_and_mask(tok, key: str, text: str, spans: list[tuple[int, int]]):
    """Token ids of `text` and the mask: 1 on each token that starts inside a span. Also checks
    that this mask is the exact one: every token touching an answer's text is in it, and each
    span ends with the stop token, followed by an unmasked token or nothing."""
    w = WRITES[key]
    enc = tok.backend_tokenizer.encode(text, add_special_tokens=False)
    starts, ends = (np.array(side) for side in zip(*enc.offsets))
    mask = np.zeros(len(enc.ids), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    for a, b in spans:
        assert mask[(starts < b) & (ends > a + len(w.header))].all()  # the answer and its stop token
        assert (ends == b).any(), f"no token ends where the span {text[a:b]!r} does"
        last = int(np.nonzero(ends == b)[0][-1])
        assert enc.ids[last] == tok.convert_tokens_to_ids(w.stop) and mask[last]
        assert last + 1 == len(mask) or not mask[last + 1]
    return enc.ids, mask


@pytest.fixture(scope="module")
def tokenizers():
    return {key: build_tokenizer(key) for key in SPECS}


def test_every_family_has_a_template():
    assert {f.template for f in FAMILIES.values()} == set(TEMPLATES) == set(WRITES)


@pytest.mark.parametrize("key", sorted(SPECS))
def test_prepared_loss_mask(key, tokenizers, tmp_path):
    tok = tokenizers[key]
    rows = [row for messages in CONVERSATIONS for row in expected_rows(tok, key, messages)]
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    prepare(PrepareConfig(inputs=[str(data)], output=str(tmp_path / "out"), progress=False, workers=1), tokenizer=tok)
    ds = TokenDataset(tmp_path / "out")
    assert len(ds) == len(rows)
    for k, (text, spans) in enumerate(rows):
        ids, mask = expected_ids_and_mask(tok, key, text, spans)
        got = ds[k]
        assert got.input_ids.tolist() == ids, (ds.source(k), tok.decode(got.input_ids))
        assert got.loss_mask.tolist() == mask.tolist(), ds.source(k)  # token by token


@pytest.mark.parametrize("key", sorted(SPECS))
def test_stop_tokens(key, tokenizers):
    tok = tokenizers[key]
    w = WRITES[key]
    stop, eos = tok.convert_tokens_to_ids(w.stop), tok.convert_tokens_to_ids(w.eos)
    assert tok.eos_token == w.eos
    assert end_of_turn_id(tok) == stop
    # the generation config as save_family writes it
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=tok.eos_token_id))
    assert stop_token_ids(tok, model) == {stop, eos}


def test_mistral_system_message_sits_on_the_answered_turn(tokenizers):
    """Mistral's template drops the system message once the conversation ends with an answer;
    each row must be what the model saw: the system message before that turn's user message."""
    tok = tokenizers["mistral"]
    rows = ChatRenderer(tok).assistant_spans(conversation(2, system=True))
    assert [text for text, _ in rows] == [
        f"<s>[INST] {SYSTEM}\n\n{USERS[0]}[/INST] {ANSWERS[0]}</s>",
        f"<s>[INST] {USERS[0]}[/INST] {ANSWERS[0]}</s>[INST] {SYSTEM}\n\n{USERS[1]}[/INST] {ANSWERS[1]}</s>",
    ]
    assert [[text[a:b] for a, b in spans] for text, spans in rows] == [[f" {ANSWERS[0]}</s>"], [f" {ANSWERS[1]}</s>"]]
