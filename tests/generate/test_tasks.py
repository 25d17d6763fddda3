"""Regeneration and synthesis bookkeeping, resume, and the output row format."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from dflash_train.data.sources import parse_row
from dflash_train.generate.config import GenerateConfig
from dflash_train.generate.engine import Completion, Request
from dflash_train.generate.job import engine_summary, run_generate
from dflash_train.generate.tasks import conversation_id, normalize_prompt
from dflash_train.target.chat_template import user_header
from dflash_train.utils.config import ConfigError, from_dict


class FakeEngine:
    """Answers chats with a deterministic echo, and writes user turns from a script."""

    name = "fake"

    def __init__(self, user_turns: list[Completion] | None = None, limit: int | None = None) -> None:
        self.user_turns = list(user_turns or [])
        self.seen: list[Request] = []
        self.limit = limit  # stop taking requests after this many (a run cut short)

    def describe(self) -> dict:
        return {"engine": self.name, "model": "fake-model"}

    def run(self, next_request, on_complete) -> None:
        while (self.limit is None or len(self.seen) < self.limit) and (req := next_request()) is not None:
            self.seen.append(req)
            if req.text is not None:
                done = self.user_turns.pop(0) if self.user_turns else Completion("", "length")
            else:
                history = " | ".join(m["content"] for m in req.messages)
                done = Completion(f"A({history})", "stop", new_tokens=4)
            on_complete(req, done)


def write_prompts(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_multi_turn_rows_are_rewritten_turn_by_turn(tmp_path, tokenizer):
    prompts = write_prompts(tmp_path / "p.jsonl", [
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
                      {"role": "assistant", "content": "old1"}, {"role": "user", "content": "u2"},
                      {"role": "assistant", "content": "old2"}], "id": "src-7"},
        {"prompt": "p", "response": "r"},
        {"text": "plain text cannot be regenerated"},
    ])  # fmt: skip
    cfg = GenerateConfig(output=str(tmp_path / "out.jsonl"), prompts=[prompts], progress=False, temperature=0.5)
    summary = run_generate(cfg, engine=FakeEngine(), tokenizer=tokenizer)
    assert summary["written"] == 2 and summary["skipped_plain_text_rows"] == 1
    rows = [json.loads(line) for line in open(cfg.output)]
    first = rows[0]["messages"]
    assert [m["role"] for m in first] == ["system", "user", "assistant", "user", "assistant"]
    assert first[2]["content"] == "A(S | u1)"
    assert first[4]["content"] == "A(S | u1 | A(S | u1) | u2)"  # sees the target's own first answer
    assert rows[0]["source"] == {"file": "p.jsonl", "line": 1, "id": "src-7"}
    assert rows[0]["finish_reasons"] == ["stop", "stop"] and rows[0]["new_tokens"] == 8
    assert rows[0]["generator"] == {
        "model": "fake-model", "engine": "fake", "temperature": 0.5, "top_p": 1.0, "top_k": 0, "seed": 0,
        "max_new_tokens": 1024, "dflash_train_version": rows[0]["generator"]["dflash_train_version"],
    }  # fmt: skip
    assert rows[1]["id"] == conversation_id("p.jsonl", 2, [{"role": "user", "content": "p"}, {"role": "assistant", "content": "r"}])
    for i, row in enumerate(rows):  # ready for `prepare`
        assert parse_row(row, "out.jsonl", i + 1).messages == row["messages"]

    again = run_generate(cfg, engine=FakeEngine(), tokenizer=tokenizer)  # everything is done: nothing to do
    assert again["written"] == 0 and again["already_done"] == 2


def test_synthesis_filters_dedupes_and_resumes(tmp_path, tokenizer):
    header = user_header(tokenizer)
    assert header.endswith("<|im_start|>user\n") and "You are a test model." in header
    turns = [
        Completion("  What is the tallest mountain on Earth?  ", "stop"),
        Completion("what is the TALLEST   mountain on earth?", "stop"),  # duplicate after normalising
        Completion("Hi", "stop"),  # too short
        Completion("Tell me a story about dragons and", "length"),  # never ended its turn
        Completion("Explain <|im_start|> tokens to me please", "stop"),  # template markup
        Completion("How do magnets attract iron filings?", "stop"),
    ]
    out = tmp_path / "synth.jsonl"
    cfg = GenerateConfig(output=str(out), synthesize=2, seed=3, progress=False, system_prompt="Be brief.")
    engine = FakeEngine(turns)
    summary = run_generate(cfg, engine=engine, tokenizer=tokenizer)
    assert summary["written"] == 2 and summary["synthetic_attempts"] == 6
    assert summary["rejected_prompts"] == {"duplicate": 1, "too short": 1, "no end of turn": 1, "template markup": 1}
    assert engine.seen[0].text == user_header(tokenizer, "Be brief.")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["syn-3-0", "syn-3-5"]
    assert rows[0]["synthetic"] is True
    assert rows[0]["messages"][:2] == [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "What is the tallest mountain on Earth?"}]
    assert rows[0]["generator"]["prompt_sampling"] == {"temperature": 1.0, "top_p": 0.95, "top_k": 0, "max_tokens": 128}

    # asking for 3: one more conversation; the earlier prompts stay de-duplicated
    cfg3 = GenerateConfig(output=str(out), synthesize=3, seed=3, progress=False, system_prompt="Be brief.")
    more = FakeEngine([Completion("How do magnets attract iron filings?", "stop")] * 6 + [Completion("Why is the sky blue today?", "stop")])
    summary = run_generate(cfg3, engine=more, tokenizer=tokenizer)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["written"] == 1 and len(rows) == 3 and len({r["id"] for r in rows}) == 3
    assert normalize_prompt(rows[2]["messages"][1]["content"]) == "why is the sky blue today?"


class KeyedEngine(FakeEngine):
    """Writes each synthetic conversation's user turn from its id, as the built-in engine does
    (its sampling is keyed by the attempt): an attempt made again gets the same user turn."""

    def __init__(self, user_turns_by_id: dict[str, Completion], after_user_turn=None) -> None:
        super().__init__()
        self.by_id, self.after_user_turn = user_turns_by_id, after_user_turn

    def run(self, next_request, on_complete) -> None:
        while (req := next_request()) is not None:
            self.seen.append(req)
            if req.text is not None:
                on_complete(req, self.by_id.get(req.tag[0].id, Completion("", "length", new_tokens=128)))
                if self.after_user_turn:
                    self.after_user_turn()
            else:
                on_complete(req, Completion("answer", "stop", new_tokens=4))


def test_a_rerun_makes_new_attempts_not_the_rejected_ones_again(tmp_path, tokenizer):
    turns = {"syn-3-2": Completion("How do tides work?", "stop", new_tokens=6),
             "syn-3-4": Completion("Why is the sky blue?", "stop", new_tokens=7)}  # attempts 0, 1 and 3 never end
    out = tmp_path / "synth.jsonl"
    first = run_generate(GenerateConfig(output=str(out), synthesize=1, seed=3, progress=False),
                         engine=KeyedEngine(turns), tokenizer=tokenizer)
    assert first["synthetic_attempts"] == 3 and first["rejected_prompts"] == {"no end of turn": 2}
    # every token the target wrote, and the tokens of the rows kept (user turn and answer)
    assert first["new_tokens"] == 2 * 128 + 6 + 4 and first["kept_tokens"] == 6 + 4

    engine = KeyedEngine(turns)
    second = run_generate(GenerateConfig(output=str(out), synthesize=2, seed=3, progress=False),
                          engine=engine, tokenizer=tokenizer)
    # attempts 0 and 1 would be rejected again: the rerun starts after attempt 2, the last written
    assert [req.tag[0].id for req in engine.seen if req.text is not None] == ["syn-3-3", "syn-3-4"]
    assert second["written"] == 1 and second["rejected_prompts"] == {"no end of turn": 1}
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["syn-3-2", "syn-3-4"]

    # a stop between a user turn and its answer: the answer is still written, the next run goes on after it
    signals = SimpleNamespace(received=None)
    stopping = KeyedEngine({"syn-3-5": Completion("What makes a rainbow?", "stop")},
                           after_user_turn=lambda: setattr(signals, "received", "SIGTERM"))
    third = run_generate(GenerateConfig(output=str(out), synthesize=4, seed=3, progress=False), engine=stopping,
                         tokenizer=tokenizer, signals=signals)
    assert third["stopped_by"] == "SIGTERM" and third["synthetic_attempts"] == 1 and third["written"] == 1
    assert [req.tag[0].id for req in stopping.seen] == ["syn-3-5", "syn-3-5"]  # the user turn, then its answer

    # another seed's rows do not move this seed's attempts
    other = KeyedEngine({"syn-30-0": Completion("What is a prime number?", "stop")})
    run_generate(GenerateConfig(output=str(out), synthesize=1, seed=30, progress=False), engine=other,
                 tokenizer=tokenizer)
    assert [req.tag[0].id for req in other.seen if req.text is not None] == ["syn-30-0"]


def test_synthesis_gives_up_when_the_target_repeats_itself(tmp_path, tokenizer):
    cfg = GenerateConfig(output=str(tmp_path / "s.jsonl"), synthesize=2, progress=False, max_attempts_factor=2)
    summary = run_generate(cfg, engine=FakeEngine([Completion("The same question every time?", "stop")] * 100), tokenizer=tokenizer)
    assert summary["written"] == 1
    assert summary["synthetic_attempts"] == 2 * 2 + 16  # synthesize x factor, plus a small allowance


def test_config_validation():
    with pytest.raises(ConfigError, match="nothing to do"):
        from_dict(GenerateConfig, {"output": "x.jsonl"})
    with pytest.raises(ConfigError, match="output"):
        from_dict(GenerateConfig, {"prompts": ["a.jsonl"]})
    with pytest.raises(ConfigError, match="top_p"):
        from_dict(GenerateConfig, {"output": "x.jsonl", "synthesize": 1, "top_p": 0})
    with pytest.raises(ConfigError, match="engine"):
        from_dict(GenerateConfig, {"output": "x.jsonl", "synthesize": 1, "engine": "vllm"})
    cfg = from_dict(GenerateConfig, {"output": "x.jsonl", "prompts": "a.jsonl,b.jsonl", "temperature": "0.7"})
    assert cfg.prompts == ["a.jsonl", "b.jsonl"] and cfg.temperature == 0.7


def _order(rows) -> list:
    return ["syn" if r.get("synthetic") else (r["source"]["file"][0], r["source"]["line"]) for r in rows]


@pytest.mark.parametrize("mix", [False, True])
def test_mix_interleaves_files_and_synthesis_by_share(tmp_path, tokenizer, mix):
    a = write_prompts(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "response": "r"} for i in range(4)])
    b = write_prompts(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "response": "r"} for i in range(2)])
    turns = [Completion(f"Question number {w} about the weather?", "stop") for w in ("one", "two", "three")]
    cfg = GenerateConfig(output=str(tmp_path / "out.jsonl"), prompts=[a, b], synthesize=3, mix=mix, progress=False)
    summary = run_generate(cfg, engine=FakeEngine(turns), tokenizer=tokenizer)
    assert summary["written"] == 9
    rows = [json.loads(line) for line in open(cfg.output)]
    if not mix:  # the files in order, then synthesis
        assert _order(rows) == [("a", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 1), ("b", 2), "syn", "syn", "syn"]
    else:  # a then b row by row; a synthetic conversation whenever synthesis (k/3) is behind the files (n/6)
        assert _order(rows) == [("a", 1), "syn", ("b", 1), ("a", 2), "syn", ("b", 2), ("a", 3), "syn", ("a", 4)]


def test_a_resumed_mix_paces_what_is_left_from_its_first_request(tmp_path, tokenizer):
    """After a cut run (a1, syn, b1), 4 prompt rows and 2 synthetic conversations are left: the
    resumed run interleaves them at their shares of what is left (2/4), as a fresh run of those
    would. Shares of the whole (1/3 synthesised against 0/4 of the files) would start b2 before
    the next synthetic one: the starvation that kept chats to 3% of a resumed 48K-row run."""
    a = write_prompts(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "response": "r"} for i in range(4)])
    b = write_prompts(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "response": "r"} for i in range(2)])
    turns = [Completion(f"Question number {w} about the weather?", "stop") for w in ("one", "two", "three")]
    cfg = GenerateConfig(output=str(tmp_path / "out.jsonl"), prompts=[a, b], synthesize=3, mix=True, progress=False)
    run_generate(cfg, engine=FakeEngine(turns[:1], limit=4), tokenizer=tokenizer)  # user turn + answer = 2
    first = [json.loads(line) for line in open(cfg.output)]
    assert _order(first) == [("a", 1), "syn", ("b", 1)]
    summary = run_generate(cfg, engine=FakeEngine(turns[1:]), tokenizer=tokenizer)
    rows = [json.loads(line) for line in open(cfg.output)]
    assert summary["written"] == 6 and len(rows) == 9
    assert _order(rows[3:]) == [("a", 2), "syn", ("b", 2), ("a", 3), "syn", ("a", 4)]


class TickingEngine(FakeEngine):
    """FakeEngine on a fake clock: every completion takes 60 s; `on_done(n)` runs after the n-th."""

    def __init__(self, clock: list[float], on_done=None) -> None:
        super().__init__()
        self.clock, self.on_done, self.done = clock, on_done, 0

    def run(self, next_request, on_complete) -> None:
        def complete(req, comp):
            self.clock[0] += 60.0
            on_complete(req, comp)
            self.done += 1
            if self.on_done:
                self.on_done(self.done)

        super().run(next_request, complete)


def _rows(path) -> dict:
    return {r["id"]: r["messages"] for r in map(json.loads, open(path))}


def _multi_turn_prompts(tmp_path) -> str:
    rows = []
    for i in range(6):
        if i == 3:  # two assistant turns: two requests
            rows.append({"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "x"},
                                      {"role": "user", "content": "and?"}, {"role": "assistant", "content": "y"}]})
        else:
            rows.append({"prompt": f"q{i}", "response": "r"})
    return write_prompts(tmp_path / "p.jsonl", rows)


def test_max_minutes_stops_taking_prompts_and_a_rerun_finishes_the_rest(tmp_path, tokenizer):
    prompts = _multi_turn_prompts(tmp_path)
    reference = GenerateConfig(output=str(tmp_path / "ref.jsonl"), prompts=[prompts], progress=False)
    run_generate(reference, engine=FakeEngine(), tokenizer=tokenizer)

    clock = [0.0]
    cfg = GenerateConfig(output=str(tmp_path / "out.jsonl"), prompts=[prompts], progress=False, max_minutes=3)
    first = run_generate(cfg, engine=TickingEngine(clock), tokenizer=tokenizer, clock=lambda: clock[0])
    # rows 1-3 take 60 s each; at 180 s the time box ends the intake: row 4 never starts
    assert first["stopped_by"] == "max_minutes=3" and first["written"] == 3
    assert list(_rows(cfg.output)) == list(_rows(reference.output))[:3]

    second = run_generate(GenerateConfig(output=cfg.output, prompts=[prompts], progress=False), engine=FakeEngine(),
                          tokenizer=tokenizer)
    assert second["stopped_by"] is None and second["already_done"] == 3 and second["written"] == 3
    assert _rows(cfg.output) == _rows(reference.output)


def test_a_stop_signal_finishes_the_conversation_started_and_a_rerun_does_the_rest(tmp_path, tokenizer):
    prompts = _multi_turn_prompts(tmp_path)
    reference = GenerateConfig(output=str(tmp_path / "ref.jsonl"), prompts=[prompts], progress=False)
    run_generate(reference, engine=FakeEngine(), tokenizer=tokenizer)

    signals = SimpleNamespace(received=None)

    def sigterm_after(n: int) -> None:  # after the first turn of the two-turn row 4
        if n == 4:
            signals.received = "SIGTERM"

    cfg = GenerateConfig(output=str(tmp_path / "out.jsonl"), prompts=[prompts], progress=False)
    engine = TickingEngine([0.0], on_done=sigterm_after)
    first = run_generate(cfg, engine=engine, tokenizer=tokenizer, signals=signals)
    # row 4's second turn is still asked for (no new row is): the turn already written is not thrown away
    assert first["stopped_by"] == "SIGTERM" and first["written"] == 4 and len(engine.seen) == 5
    assert list(_rows(cfg.output)) == list(_rows(reference.output))[:4]

    second = run_generate(cfg, engine=FakeEngine(), tokenizer=tokenizer, signals=SimpleNamespace(received=None))
    assert second["written"] == 2 and _rows(cfg.output) == _rows(reference.output)


def test_without_a_progress_bar_progress_is_logged(tmp_path, tokenizer, caplog):
    prompts = _multi_turn_prompts(tmp_path)
    cfg = GenerateConfig(output=str(tmp_path / "out.jsonl"), prompts=[prompts], progress=False, log_every_seconds=1e-9)
    with caplog.at_level(logging.INFO, logger="dflash_train.generate.job"):
        run_generate(cfg, engine=FakeEngine(), tokenizer=tokenizer)
    lines = [r.getMessage() for r in caplog.records if "conversations written" in r.getMessage()]
    assert [line.split(",")[0] for line in lines] == [f"generate: {n} of 6 conversations written" for n in range(1, 7)]


def test_engine_summary_derives_step_time_utilisation_and_rates():
    stats = {"prompt_tokens": 300, "new_tokens": 500, "completed": 5, "prefill_seconds": 0.5, "decode_seconds": 2.0,
             "decode_steps": 100, "slot_steps_active": 600}
    out = engine_summary(stats, slots=8)
    assert out["ms_per_decode_step"] == 20.0 and out["slot_utilisation"] == 0.75
    assert out["decode_tok_per_s"] == 300.0 and out["prefill_tok_per_s"] == 600.0
    assert engine_summary({"decode_steps": 0}, slots=8) == {"decode_steps": 0}
