"""Conversation -> (input_ids, loss_mask) with any chat template.

The loss mask marks exactly the tokens the assistant produces at inference time: each
assistant message's content plus the template's end-of-turn marker (`<|im_end|>`,
`<｜end▁of▁sentence｜>`, `<|eot_id|>`, ...). It never marks role headers, the system
prompt, user turns, or the separator a template writes after the end-of-turn marker
(ChatML's trailing newline: the model stops at `<|im_end|>` and never generates it).

How the assistant spans are found, without knowing anything about the template:

    P_i = render(messages[:i], add_generation_prompt=True)   # ... <|im_start|>assistant\n
    F_i = render(messages[:i + 1])                           # ... <|im_start|>assistant\nHi<|im_end|>\n

for every assistant message i. The generation prompt is what the serving engine feeds
the model before it starts writing, so `F_i[len(P_i):]` is what the model itself writes
for that turn, plus whatever separator the template appends after the turn. The span ends
at the model's end-of-turn token (`chat_template.turn_end`, found by rendering a sentinel
answer): what the template writes after it is a separator the model never generates
(ChatML's newline, the EOS Phi-3 writes after `<|end|>`); a template without such a token
ends the span before trailing whitespace. GLM writes no end-of-turn token at all: the model
ends its turn by writing the next message's role token (`<|user|>`), so each span is
followed by that token, appended to the text after the last answer.

Turn i's row is P_i followed by that output. If every row (up to its span's end) is a prefix
of the last one, the conversation is that one row with every span (messages after the last
assistant turn carry no loss and are dropped). A template that re-renders earlier turns once
the conversation goes on (Qwen3 and DeepSeek-R1 drop the reasoning of old turns, gpt-oss ends
a final answer with `<|return|>` but an old one with `<|end|>`) breaks that; such a
conversation becomes one row per assistant turn: the conversation up to turn i as the model
sees it then, with that turn's span only.

P_i is normally a prefix of F_i. Mistral's template breaks that: it puts the system message
on the last message when that is a user turn, so P_i has it and F_i has not. The model's
output in F_i then starts after the longest tail of P_i that F_i repeats before the answer
(`... u_i[/INST]`), and the row is P_i (the prompt the model really gets) followed by it.

The full text is tokenized once, without extra special tokens (the template writes
them, e.g. DeepSeek's BOS), and a token is in the mask iff its first character lies in
a span. Templates that inject text (SmolLM2's default system prompt, a BOS) need no
special care: injected text is outside every span.

Plain-text rows: every token is in the loss mask; the tokenizer adds its own special
tokens (e.g. a BOS) as it would for any text, and `text_eos=True` appends EOS.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from dflash_train.data.sources import Record
from dflash_train.target.chat_template import SENTINEL, turn_end
from dflash_train.utils.errors import DataError, DFlashError, ModelError


class TemplateError(ModelError):
    """The tokenizer cannot render conversations at all (e.g. it has no chat template)."""


class RenderError(DFlashError):
    """One conversation cannot be rendered; `field` names the message at fault."""

    def __init__(self, field: str | None, problem: str):
        self.field, self.problem = field, problem
        super().__init__(f"{field}: {problem}" if field else problem)


class ChatRenderer:
    """Turns Records into token ids and loss masks with one tokenizer and chat template.

    Picklable (the Hugging Face tokenizer is), so it can be shipped to worker processes.
    """

    def __init__(self, tokenizer: Any, *, chat_template: str | None = None, text_eos: bool = False):
        self.tokenizer = tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None) or None
        self.text_eos = text_eos
        # The Rust tokenizer: ids (and character offsets) without the Python wrapper's overhead.
        # Slow (Python) tokenizers have no offsets, so they cannot be used.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        if self._backend is None:
            raise TemplateError("a fast tokenizer (tokenizer.json) is needed: offsets locate the assistant tokens")
        self._byte_len = _byte_lengths(self._backend)
        # How the template ends an assistant turn, found once by rendering a sentinel answer.
        self._turn_end = turn_end(tokenizer, self.chat_template) if self.chat_template else None

    # -- rendering -------------------------------------------------------------------------

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool, upto: int) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=generation_prompt,
                chat_template=self.chat_template,
            )
        except Exception as exc:  # jinja2 errors from `raise_exception(...)` in templates, and others
            raise RenderError("messages", f"the chat template rejected the conversation up to messages[{upto}]: {exc}") from None
        if not isinstance(text, str):
            raise TemplateError(f"apply_chat_template returned {type(text).__name__}, expected text")
        return text

    def assistant_spans(self, messages: list[dict[str, str]]) -> list[tuple[str, list[tuple[int, int]]]]:
        """The rows of one conversation: (rendered text, character spans [start, end) of the
        assistant's tokens). One row, unless the template re-renders history (see above)."""
        if not self.chat_template:
            raise TemplateError(
                "the tokenizer has no chat template, so chat rows cannot be rendered; "
                "pass one with --chat-template FILE (a Jinja file) or use plain 'text' rows"
            )
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise RenderError("messages", "has no assistant turn (nothing to learn from)")
        if turns[0] == 0:
            # Hugging Face refuses to render an empty conversation, so there is no
            # generation prompt to diff against (and templates inject a system prompt here).
            raise RenderError("messages[0]", "the conversation must not open with an assistant turn")
        rows = [self._turn_row(messages, i) for i in turns]
        full = rows[-1][0]
        if all(full.startswith(text[:end]) for text, (_, end) in rows):
            return [(full, [span for _, span in rows])]
        return [(text, [span]) for text, span in rows]  # history is re-rendered: one row per turn

    def _turn_row(self, messages: list[dict[str, str]], i: int) -> tuple[str, tuple[int, int]]:
        """Assistant turn i as the model meets it: (the generation prompt of messages[:i] followed
        by what the model writes, the span of the latter)."""
        prompt = self._render(messages[:i], True, i - 1)
        done = self._render(messages[: i + 1], False, i)
        start = len(prompt) if done.startswith(prompt) else self._aligned_start(messages, i, prompt, done)
        output = done[start:]
        end = self._output_end(output)
        # A template that writes no end-of-turn token (GLM) leaves the model's stop token to
        # the next message; the model still writes it, so the row carries it.
        token = self._turn_end.token if self._turn_end is not None and not self._turn_end.written else ""
        text = prompt + output[:end] + token + output[end:]
        return text, (len(prompt), len(prompt) + end + len(token))

    def _output_end(self, output: str) -> int:
        """How much of `output` (turn i as the template writes it after the generation prompt)
        the model writes: through its end-of-turn token. The rest is the template's separator
        (ChatML's newline; Phi-3 puts the tokenizer's EOS after `<|end|>`)."""
        end = self._turn_end
        if end is not None and not end.written:
            return len(output)
        if end is not None and output.endswith(end.trailer):
            return len(output) - len(end.trailer) + end.trailer.index(end.token) + len(end.token)
        return len(output.rstrip())  # a plain-text end of turn: trailing whitespace is the separator

    def _aligned_start(self, messages: list[dict[str, str]], i: int, prompt: str, done: str) -> int:
        """Where the model's output starts in `done` when the generation prompt is not a prefix
        of it: the template renders the context differently once the answer follows (Mistral puts
        the system message on the last message if that is a user turn, so it vanishes once the
        turn is answered). The output follows the longest tail of the prompt that `done` repeats
        before the answer's text."""
        probe = self._render(messages[:i] + [{**messages[i], "content": SENTINEL}], False, i)
        answer = len(os.path.commonprefix([done, probe]))  # the answer's text starts here or later
        start = _end_of_longest_tail(prompt, done, len(os.path.commonprefix([prompt, done])), answer)
        if start is None:
            raise RenderError(
                f"messages[{i}]",
                "the chat template's generation prompt does not match the rendered assistant turn; "
                "cannot tell where the assistant's tokens start",
            )
        return start

    # -- tokenization ----------------------------------------------------------------------

    def encode_messages(self, messages: list[dict[str, str]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(input_ids int32, loss_mask bool) of each row of one conversation (see `assistant_spans`).
        Raises RenderError/TemplateError."""
        return self._encode_rendered(self.assistant_spans(messages))

    def _encode_rendered(self, rendered: list[tuple[str, list[tuple[int, int]]]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Tokenize rendered conversations in one call (the Rust tokenizer may use several threads)."""
        texts = [text for text, _ in rendered]
        if self._byte_len is None:
            encodings = self._backend.encode_batch(texts, add_special_tokens=False)
            return [self._mask_from_offsets(e, spans) for e, (_, spans) in zip(encodings, rendered)]
        # Byte-level BPE: token i covers exactly byte_len[id_i] bytes of the text, so token
        # start offsets are a cumulative sum and the tokenizer need not track offsets (~20%
        # faster). Every row is checked (the byte counts must add up to the text's), and a
        # row that does not add up (e.g. an added token that strips spaces) uses offsets.
        out = []
        for enc, (text, spans) in zip(self._backend.encode_batch_fast(texts, add_special_tokens=False), rendered):
            ids = np.asarray(enc.ids, dtype=np.int32)
            sizes = self._byte_len[ids]
            raw = text.encode("utf-8")
            if int(sizes.sum()) != len(raw):
                out.append(self._mask_from_offsets(self._backend.encode(text, add_special_tokens=False), spans))
                continue
            starts = np.cumsum(sizes) - sizes
            mask = np.zeros(len(ids), dtype=bool)
            ascii_only = len(raw) == len(text)
            for a, b in spans:
                if not ascii_only:  # character -> byte positions
                    a, b = len(text[:a].encode("utf-8")), len(text[:b].encode("utf-8"))
                mask |= (starts >= a) & (starts < b)
            out.append((ids, mask))
        return out

    @staticmethod
    def _mask_from_offsets(enc: Any, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(enc.ids, dtype=np.int32)
        starts = np.fromiter((o[0] for o in enc.offsets), dtype=np.int64, count=len(ids))
        mask = np.zeros(len(ids), dtype=bool)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
        return ids, mask

    def encode_text(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = list(self._backend.encode(text, add_special_tokens=True).ids)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if self.text_eos and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return np.asarray(ids, dtype=np.int32), np.ones(len(ids), dtype=bool)

    def encode_record(self, record: Record) -> list[tuple[np.ndarray, np.ndarray]]:
        """Token rows of one Record; a row the template rejects raises DataError naming file:line."""
        out = self.encode_records([record])[0]
        if isinstance(out, DataError):
            raise out
        return out

    def encode_records(self, records: list[Record]) -> list[list[tuple[np.ndarray, np.ndarray]] | DataError]:
        """Token rows of many Records, in order (one per record, or one per assistant turn
        for templates that re-render history); records the template rejects come back as
        DataError. Configuration problems (no chat template at all) raise TemplateError."""
        out: list[Any] = [None] * len(records)
        rendered, owner = [], []
        for k, rec in enumerate(records):
            if rec.messages is None:
                out[k] = [self.encode_text(rec.text or "")]
                continue
            try:
                rows = self.assistant_spans(rec.messages)
            except RenderError as err:
                out[k] = DataError(rec.file, rec.line, err.field, err.problem)
                continue
            out[k] = []
            rendered.extend(rows)
            owner.extend([k] * len(rows))
        for k, encoded in zip(owner, self._encode_rendered(rendered)):  # one tokenizer call for all
            out[k].append(encoded)
        return out


def _end_of_longest_tail(prompt: str, done: str, lo: int, hi: int) -> int | None:
    """The end of the last occurrence in done[:hi], ending at lo or later, of the longest tail of
    `prompt` that occurs so; None if not even one character does. Binary search on the tail's
    length: a tail that occurs there has every shorter tail occurring there too."""
    best, short, long = None, 1, min(len(prompt), hi)
    while short <= long:
        m = (short + long) // 2
        at = done.rfind(prompt[-m:], 0, hi)
        if at >= 0 and at + m >= lo:
            best, short = at + m, m + 1
        else:
            long = m - 1
    return best


def _byte_lengths(backend: Any) -> np.ndarray | None:
    """Bytes of text each token id stands for, for byte-level BPE tokenizers without a
    normalizer (GPT-2 style: SmolLM2, Qwen, Llama 3, DeepSeek); None for any other kind."""
    normalizer = backend.normalizer
    if type(backend.decoder).__name__ != "ByteLevel":
        return None
    if normalizer is not None and json.loads(normalizer.__getstate__()) != {"type": "Sequence", "normalizers": []}:
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    table = np.zeros(max(vocab.values()) + 1, dtype=np.int64)
    for token, i in vocab.items():
        # A byte-level token is one character per byte; an added token is its literal text.
        table[i] = len(token.encode("utf-8")) if token in added else len(token)
    return table
