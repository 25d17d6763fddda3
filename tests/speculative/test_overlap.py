"""Pipelined rounds (SpecEngine(overlap_rounds=True), speculative/engine.py): round r+1 is
launched before round r is read, so a row that finishes in round r is stepped once more. The
outputs, finish reasons and every round's drafted / accepted / committed counts equal the
engine's one-round-at-a-time run and plain greedy decoding, for rows that end on a stop token
or the limit at every offset within a block, with refills, and at the KV cache's last position
(on CPU a write past the cache raises). CPU, fp32."""

from __future__ import annotations

import pytest
import torch

from dflash_train.speculative.engine import SpecEngine
from dflash_train.speculative.loop import Round

from ..eval.conftest import plain_greedy, random_drafter
from .test_engine import OracleDrafts, random_prompts

B = 4


def decode_both(model, make_source, stop, prompts, max_new, *, slots=1, max_len=128, speculative=True, refill=0.125):
    """(overlapped, one round at a time) results of the same run. Afterwards every slot is
    inactive on the device, and at batch 1 the device counted exactly the tokens the host got
    (a row that ended at its prefill or in a round committed nothing more)."""
    out = []
    for overlap in (True, False):
        engine = SpecEngine(model, make_source(), stop, slots=slots, max_len=max_len, overlap_rounds=overlap,
                            refill_fraction=refill)
        out.append(engine.generate_batch(prompts, max_new, speculative=speculative))
        assert not engine.active.any()
        if slots == 1:
            assert engine.n_out.tolist() == [len(out[-1][-1].tokens)]
    return out


def summary(results):
    return [(r.tokens, r.rounds, r.finish_reason) for r in results]


def first_occurrences(ref: list[int], upto: int) -> list[int]:
    """Output indices i < upto whose token does not occur before i: a stop token there ends the output at i."""
    return [i for i in range(min(upto, len(ref))) if ref[i] not in ref[:i]]


def test_rows_ending_at_every_offset_within_a_block(targets):
    """Batch 1: a stop token at each output index 0..2B+1 (with full acceptance rounds span
    1..B, B+1..2B: every offset in a block, and the prefill's token itself), and each limit
    1..2B+2; with a full-acceptance oracle and a mixed script. Overlapped = one round at a
    time = plain greedy's prefix, round for round."""
    model, _ = targets["llama"]
    vocab = model.config.vocab_size
    prompt = random_prompts(vocab, (7,), seed=11)[0]
    n = 3 * B + 2
    ref = plain_greedy(model, [1, 3], set(), prompt, n).tokens
    stops = first_occurrences(ref, 2 * B + 2)
    assert len(stops) >= B + 2  # enough distinct offsets for the test to mean something
    cases = [({ref[i]}, n, ref[:i + 1], "stop") for i in stops]
    cases += [(set(), m, ref[:m], "length") for m in range(1, 2 * B + 3)]
    for pattern in ([B - 1], [B - 1, 0, 2, 1]):
        for stop, max_new, expect, reason in cases:
            make = lambda: OracleDrafts({tuple(prompt): ref}, B, pattern, vocab)  # noqa: E731
            fast, plain = decode_both(model, make, stop, [prompt], max_new)
            assert summary(fast) == summary(plain) == [(expect, plain[0].rounds, reason)], (pattern, stop, max_new)
            assert sum(r.committed for r in fast[0].rounds) == len(expect) - 1
    for m in (1, 2, 5):  # plain greedy through the same loop
        fast, plain = decode_both(model, lambda: None, set(), [prompt], m, speculative=False)
        assert summary(fast) == summary(plain) == [(ref[:m], [Round(0, 0, 1)] * (m - 1), "length")]
        assert fast[0].margins == plain[0].margins and len(fast[0].margins) == m


@pytest.mark.parametrize("source", ["dflash", "scripted", "greedy"])
def test_batched_with_refills(source, targets):
    """8 prompts through 3 slots (refills as rows finish, some by a stop token, some by the limit,
    one on its first token): every prompt's tokens and rounds equal batch 1's one-round-at-a-time
    run, with the real static drafter, scripted drafts and plain greedy."""
    model, tok = targets["llama"]
    vocab = model.config.vocab_size
    prompts = random_prompts(vocab, (12, 1, 30, 5, 21, 2, 9, 17), seed=4)
    new = 24
    free_run = {tuple(p): plain_greedy(model, [0], set(), p, new).tokens for p in prompts}
    outs = list(free_run.values())
    # stop tokens: one output's first token (it ends at its prefill) and a token early in others
    stop = {outs[3][0], max(set(outs[0][2:9]) - {outs[0][0]}, key=lambda t: sum(t in o[:new // 2] for o in outs))}
    drafter = random_drafter(model, tok, B, sliding=3)
    make = {"dflash": lambda: drafter, "scripted": lambda: OracleDrafts(free_run, B, [3, 0, 1, 2], vocab),
            "greedy": lambda: None}[source]
    speculative = source != "greedy"
    one = SpecEngine(model, make(), stop, slots=1, max_len=128, overlap_rounds=False)
    expected = [one.generate(p, new, speculative=speculative) for p in prompts]
    assert {r.finish_reason for r in expected} == {"stop", "length"} and any(len(r.tokens) == 1 for r in expected)
    for refill in (0.125, 0.7):  # refill as soon as a slot frees; wait for 2 free slots
        fast, plain = decode_both(model, make, stop, prompts, new, slots=3, speculative=speculative, refill=refill)
        assert summary(fast) == summary(plain) == summary(expected)
        for p, f, e in zip(prompts, fast, expected):
            assert f.tokens == free_run[tuple(p)][:len(f.tokens)]
            if speculative:
                assert f.margins is None
            else:
                assert f.margins == pytest.approx(e.margins, abs=1e-4)


def test_rows_ending_at_the_cache_end(targets):
    """Prompts of max_len - max_new - B tokens (the longest an engine takes): the last round of
    each reaches the cache's last position, and the kv bucket of the round launched behind it
    (position + 2B) would pass the cache; full acceptance, a mixed script and greedy, batch 1
    and 2 slots with a refill."""
    model, _ = targets["qwen3"]
    vocab, max_len = model.config.vocab_size, 128
    lengths = [max_len - m - B for m in (9, 10, 11, 12)]  # limits 9..12: the last round at each offset
    prompts = random_prompts(vocab, lengths, seed=3)
    refs = {tuple(p): plain_greedy(model, [1, 3], set(), p, 12).tokens for p in prompts}
    for pattern in ([B - 1], [2, B - 1, 0]):
        make = lambda: OracleDrafts(refs, B, pattern, vocab)  # noqa: E731
        for p, m in zip(prompts, (9, 10, 11, 12)):
            fast, plain = decode_both(model, make, set(), [p], m, max_len=max_len)
            assert summary(fast) == summary(plain) == [(refs[tuple(p)][:m], plain[0].rounds, "length")]
    m = 12
    fast, plain = decode_both(model, lambda: OracleDrafts(refs, B, [B - 1], vocab), set(), prompts[-1:] * 3, m,
                              slots=2, max_len=max_len)
    assert summary(fast) == summary(plain) and all(r.tokens == refs[tuple(prompts[-1])] for r in fast)
    longest = random_prompts(vocab, (max_len - m - 1,), seed=5)  # plain greedy: blocks of 1
    fast, plain = decode_both(model, lambda: None, set(), longest, m, max_len=max_len, speculative=False)
    assert summary(fast) == summary(plain) == [(plain_greedy(model, [0], set(), longest[0], m).tokens,
                                                [Round(0, 0, 1)] * (m - 1), "length")]


def test_rows_crossing_kv_buckets(targets):
    """Rows crossing the 128-position bucket (dense attention reads only the bucket's keys) with
    full acceptance: the round launched while another is in flight must allow for that one
    committing a whole block, else its last queries miss their own keys."""
    model, _ = targets["llama"]
    vocab, new = model.config.vocab_size, 40
    prompts = random_prompts(vocab, (97, 98, 99, 100), seed=9)
    refs = {tuple(p): plain_greedy(model, [1, 3], set(), p, new).tokens for p in prompts}
    for p in prompts:
        fast, plain = decode_both(model, lambda: OracleDrafts(refs, B, [B - 1], vocab), set(), [p], new, max_len=256)
        assert summary(fast) == summary(plain) == [(refs[tuple(p)], [Round(3, 3, 4)] * 9 + [Round(2, 2, 3)], "length")]


def test_one_host_read_per_round_and_none_per_prompt(targets, monkeypatch):
    """The host reads the device once per round (the report; plain greedy also its top-2
    logits) and never per prompt: counted on the tensor methods that read values back."""
    model, tok = targets["llama"]
    prompts = random_prompts(model.config.vocab_size, (12, 1, 30, 5, 21), seed=4)
    reads = {"n": 0}
    for name in ("tolist", "item"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _original=original, **k):
            reads["n"] += 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for speculative, per_round in ((True, 1), (False, 2)):
        engine = SpecEngine(model, random_drafter(model, tok, B, sliding=3), set(), slots=2, max_len=128)
        reads["n"] = 0
        engine.generate_batch(prompts, 16, speculative=speculative)
        assert reads["n"] == per_round * engine.rounds_launched


def test_round_r_is_read_after_round_r_plus_1_is_launched(targets, monkeypatch):
    """The pipelining itself: overlapped, every round but the last of a run is read after the
    next one was launched (and never later); one at a time, each is read before the next launch.
    Greedy rows that end by the limit cost no extra round (each round in flight commits at
    least one token, so the host knows they are done); a row ending on a stop token costs one."""
    model, _ = targets["llama"]
    vocab = model.config.vocab_size
    prompt = random_prompts(vocab, (9,), seed=2)[0]
    ref = plain_greedy(model, [0], set(), prompt, 20).tokens
    lags = []
    original = SpecEngine._collect

    def collect(self, launched, finish):
        lags.append(self.rounds_launched - launched.index - 1)  # rounds launched since this one
        return original(self, launched, finish)

    original_launch = SpecEngine._launch

    def launch(self, width, speculative):
        launched = original_launch(self, width, speculative)
        if launched is not None:
            launched.index = self.rounds_launched - 1
        return launched

    monkeypatch.setattr(SpecEngine, "_collect", collect)
    monkeypatch.setattr(SpecEngine, "_launch", launch)
    for overlap in (True, False):
        engine = SpecEngine(model, None, set(), overlap_rounds=overlap)
        lags.clear()
        res = engine.generate(prompt, 20, speculative=False)
        assert res.tokens == ref and len(res.rounds) == 19
        assert engine.rounds_launched == 19  # no round wasted at the limit
        assert lags == ([1] * 18 + [0] if overlap else [0] * 19)
    stop_at = min(first_occurrences(ref, 20), key=lambda i: abs(i - 10))  # well before the limit
    engine = SpecEngine(model, None, {ref[stop_at]}, overlap_rounds=True)
    res = engine.generate(prompt, 20, speculative=False)
    assert res.tokens == ref[:stop_at + 1] and len(res.rounds) == stop_at
    assert engine.rounds_launched == stop_at + 1  # the round launched behind the stop, discarded
