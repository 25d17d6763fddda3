"""What `generate` asks the target to write, and how answers become output rows.

Two sources of conversations feed one engine:

(a) regenerate: every assistant turn of a prompt row is rewritten by the target, in order,
    each given the conversation so far *with the target's own earlier answers*, so a
    multi-turn row keeps its structure and every assistant turn is target-written.
(b) synthesise: the target first writes a user turn, continuing the chat template's bare
    user header (`...<|im_start|>user\\n` for ChatML) up to its end-of-turn, then answers it.
    User turns that do not end in time, are too short, contain template markup, or repeat
    an earlier one (after case/whitespace normalisation) are dropped and another attempt
    is made.

Ids are stable, so a rerun skips finished conversations: (a) a hash of the source file
name, row number and the row's messages; (b) `syn-{seed}-{attempt}`. A user turn's sampling is
keyed by its attempt, so an attempt rejected once would be rejected again: a rerun makes new
attempts after the last one written, not the earlier run's rejected ones.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from dflash_train import __version__
from dflash_train.data.sources import Record
from dflash_train.generate.config import GenerateConfig
from dflash_train.generate.engine import Completion, Request
from dflash_train.generate.sampling import request_key
from dflash_train.target.chat_template import special_strings

log = logging.getLogger(__name__)

STOP_ANNOUNCE = ("taking no new prompts, finishing the conversations started, then the summary "
                 "(Ctrl-C again to stop at once; finished rows are saved either way)")


def conversation_id(file: str | Path, line: int, messages: list[dict[str, str]]) -> str:
    """Stable id of a prompt row: survives moving the file, changes when the row changes."""
    payload = f"{Path(file).name}:{line}\n" + json.dumps(messages, ensure_ascii=False, sort_keys=True)
    return "r-" + hashlib.sha256(payload.encode()).hexdigest()[:20]


def synthetic_id(seed: int, attempt: int) -> str:
    return f"syn-{seed}-{attempt}"


def normalize_prompt(text: str) -> str:
    """The de-duplication key of a user turn: case- and whitespace-insensitive."""
    return " ".join(text.lower().split())


@dataclass
class _Conversation:
    id: str
    messages: list[dict[str, str]]
    turn: int = -1  # index of the assistant message being written
    synthetic: bool = False
    user_tokens: int = 0  # a synthetic conversation's user turn, written by the target
    source: dict[str, Any] | None = None
    finish_reasons: list[str] = field(default_factory=list)
    new_tokens: int = 0

    def next_assistant(self) -> int | None:
        return next((i for i in range(self.turn + 1, len(self.messages)) if self.messages[i]["role"] == "assistant"), None)


@dataclass
class Counters:
    written: int = 0
    skipped_errors: int = 0
    skipped_text_rows: int = 0
    bad_rows: int = 0
    rejected_prompts: dict[str, int] = field(default_factory=dict)
    synth_attempts: int = 0
    new_tokens: int = 0  # every token the target wrote, rejected user turns included
    kept_tokens: int = 0  # the target's tokens in the rows written (user turns and answers)


@dataclass
class Resumed:
    """What an earlier run wrote to the output, read before a rerun starts."""

    done_ids: set[str] = field(default_factory=set)
    seen_prompts: set[str] = field(default_factory=set)  # the synthetic user turns, normalised
    synth_done: int = 0  # synthetic rows of this seed
    next_attempt: int = 0  # one past the highest attempt of this seed written
    rows: int = 0
    generators: dict[str, dict[str, Any]] = field(default_factory=dict)  # the distinct settings rows were written with


# the row settings that shape the answers (a resume with other ones would mix them in one file)
ANSWER_SETTINGS = ("model", "temperature", "top_p", "top_k", "max_new_tokens")


class Driver:
    """Feeds an engine (`next_request`) and turns its completions into rows (`on_complete`)."""

    def __init__(
        self,
        cfg: GenerateConfig,
        write: Callable[[dict[str, Any]], None],
        engine_info: dict[str, Any],
        *,
        done: Resumed,
        records: Iterator[Record] | None = None,
        records_total: int = 0,
        header: str | None = None,
        tokenizer=None,
        on_row: Callable[[int], None] | None = None,
        should_stop: Callable[[], str | None] | None = None,
    ) -> None:
        self.cfg, self.write, self.done_ids = cfg, write, done.done_ids
        # asked before every new request: a reason (signal, time box) ends the intake for good
        self.should_stop = should_stop
        self.stopped_by: str | None = None
        self.records = records
        # --mix: a synthetic conversation starts whenever synthesis is behind the files' progress
        self.records_total, self.records_started = records_total, 0
        self.header = header
        self.specials = special_strings(tokenizer)
        self.seen = done.seen_prompts
        self.counts = Counters()
        self.on_row = on_row
        self._ready: deque[Request] = deque()  # follow-up turns, served before new conversations
        base = {
            "model": engine_info.get("model", ""),
            "engine": engine_info.get("engine", ""),
            **cfg.answer_sampling.to_dict(),
            "seed": cfg.seed,
            "max_new_tokens": cfg.max_new_tokens,
            "dflash_train_version": __version__,
        }
        self.generator = base
        self.synth_generator = {**base, "prompt_sampling": {**cfg.prompt_sampling.to_dict(), "max_tokens": cfg.prompt_max_tokens}}
        # synthesis accounting: rows already written + attempts in flight must not pass the target
        self.synth_have, self.synth_inflight = done.synth_done, 0
        self.synth_at_start = done.synth_done  # --mix paces what is left of each, from where a resume begins
        remaining = max(0, cfg.synthesize - done.synth_done)
        self.synth_max_attempts = math.ceil(remaining * cfg.max_attempts_factor) + (16 if remaining else 0)
        self._next_attempt = done.next_attempt  # past every attempt of this seed already written

    # --- requests -----------------------------------------------------------------------

    def next_request(self) -> Request | None:
        if self.stopped_by is None and self.should_stop is not None:
            self.stopped_by = self.should_stop()
            if self.stopped_by:
                log.info("generate: stopping (%s): taking no new prompts, finishing the conversations started",
                         self.stopped_by)
        # a started conversation's next turn, also after a stop: no turn already written is thrown
        # away (a rerun does not make a synthetic conversation's attempt again)
        if self._ready:
            return self._ready.popleft()
        if self.stopped_by:
            return None
        if self.cfg.mix and self._synthesis_behind():
            req = self._start_synthetic()
            if req is not None:
                return req
        while self.records is not None:
            record = next(self.records, None)
            if record is None:
                self.records = None
                break
            req = self._start_regenerate(record)
            if req is not None:
                return req
        return self._start_synthetic()

    def _synthesis_behind(self) -> bool:
        # Both shares count this run's part of what was left when it started (records_total is the
        # prompt rows not done yet): a resumed run interleaves from its first request, where shares of
        # the whole would hold synthesis back until the files caught up with the rows already written.
        left = self.cfg.synthesize - self.synth_at_start
        if self.header is None or left <= 0:
            return False
        if self.records is None or self.records_total <= 0:
            return True
        synth_share = (self.synth_have - self.synth_at_start + self.synth_inflight) / left
        return synth_share < self.records_started / self.records_total

    def _answer_request(self, conv: _Conversation) -> Request:
        sampling = self.cfg.answer_sampling
        return Request(
            messages=conv.messages[: conv.turn],
            sampling=sampling,
            max_new_tokens=self.cfg.max_new_tokens,
            key=request_key(self.cfg.seed, conv.id, conv.turn),
            tag=(conv, "answer"),
        )

    def _start_regenerate(self, record: Record) -> Request | None:
        if record.messages is None:
            self.counts.skipped_text_rows += 1
            return None
        cid = conversation_id(record.file, record.line, record.messages)
        if cid in self.done_ids:
            return None
        self.done_ids.add(cid)  # an id met twice (same file name, row and content) is written once
        self.records_started += 1
        source = {"file": Path(record.file).name, "line": record.line}
        if "id" in record.extra:
            source["id"] = record.extra["id"]
        conv = _Conversation(cid, [dict(m) for m in record.messages], source=source)
        conv.turn = conv.next_assistant()  # type: ignore[assignment] - rows always have one
        return self._answer_request(conv)

    def _start_synthetic(self) -> Request | None:
        if self.header is None or self.synth_have + self.synth_inflight >= self.cfg.synthesize:
            return None
        if self.counts.synth_attempts >= self.synth_max_attempts:
            return None
        cid = synthetic_id(self.cfg.seed, self._next_attempt)
        self._next_attempt += 1
        self.counts.synth_attempts += 1
        self.synth_inflight += 1
        return Request(
            text=self.header,
            sampling=self.cfg.prompt_sampling,
            max_new_tokens=self.cfg.prompt_max_tokens,
            key=request_key(self.cfg.seed, cid, "user"),
            tag=(_Conversation(cid, [], synthetic=True), "user"),
        )

    # --- completions --------------------------------------------------------------------

    def on_complete(self, request: Request, completion: Completion) -> None:
        conv, stage = request.tag
        self.counts.new_tokens += completion.new_tokens
        if stage == "user":
            self._on_user_turn(conv, completion)
        elif not completion.ok:
            self.counts.skipped_errors += 1
            log.warning("skipping conversation %s: %s", conv.id, completion.error)
            if conv.synthetic:
                self.synth_inflight -= 1
            else:
                self.done_ids.discard(conv.id)
        else:
            conv.messages[conv.turn] = {"role": "assistant", "content": completion.text}
            conv.finish_reasons.append(completion.finish_reason)
            conv.new_tokens += completion.new_tokens
            nxt = conv.next_assistant()
            if nxt is not None:
                conv.turn = nxt
                self._ready.append(self._answer_request(conv))
            else:
                self._write(conv)

    def _reject(self, reason: str) -> None:
        self.synth_inflight -= 1
        self.counts.rejected_prompts[reason] = self.counts.rejected_prompts.get(reason, 0) + 1

    def _on_user_turn(self, conv: _Conversation, completion: Completion) -> None:
        text = completion.text.strip()
        if not completion.ok:
            return self._reject("error")
        if completion.finish_reason != "stop":
            return self._reject("no end of turn")
        if len(text) < self.cfg.prompt_min_chars:
            return self._reject("too short")
        if any(s in text for s in self.specials):
            return self._reject("template markup")
        key = normalize_prompt(text)
        if key in self.seen:
            return self._reject("duplicate")
        self.seen.add(key)
        system = [{"role": "system", "content": self.cfg.system_prompt}] if self.cfg.system_prompt else []
        conv.messages = system + [{"role": "user", "content": text}, {"role": "assistant", "content": ""}]
        conv.user_tokens = completion.new_tokens
        conv.turn = len(conv.messages) - 1
        self._ready.append(self._answer_request(conv))

    def _write(self, conv: _Conversation) -> None:
        row: dict[str, Any] = {"id": conv.id, "messages": conv.messages}
        if conv.synthetic:
            row["synthetic"] = True
            row["generator"] = self.synth_generator
            self.synth_inflight -= 1
            self.synth_have += 1
        else:
            row["generator"] = self.generator
            row["source"] = conv.source
        row["finish_reasons"] = conv.finish_reasons
        row["new_tokens"] = conv.new_tokens
        self.write(row)
        self.counts.written += 1
        self.counts.kept_tokens += conv.user_tokens + conv.new_tokens
        if self.on_row is not None:
            self.on_row(conv.new_tokens)
