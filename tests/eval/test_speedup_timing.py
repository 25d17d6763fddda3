"""Eval's speedup from repeated timings (speculative/metrics.py: `_timed_speedup`) and the word it
prints when no draft was accepted; exact values from hand-made decode results."""

from __future__ import annotations

import pytest

from dflash_train.eval.report import summary_lines
from dflash_train.speculative.evaluate import build_report
from dflash_train.speculative.loop import DecodeResult, Round
from dflash_train.speculative.metrics import PromptResult


def _result(tokens: int, seconds: float, accepted: int, greedy_seconds: float, repeats) -> PromptResult:
    # one round committing `accepted + 1` tokens, then one-token rounds up to `tokens`
    rounds = [Round(3, accepted, accepted + 1)] + [Round(3, 0, 1)] * (tokens - 2 - accepted)
    spec = DecodeResult(list(range(tokens)), rounds, "length", seconds, 0.0)
    greedy = DecodeResult(list(range(tokens)), [Round(0, 0, 1)] * (tokens - 1), "length", greedy_seconds, 0.0)
    return PromptResult("p", 5, spec, greedy, None, list(repeats))


def test_the_speedup_is_the_median_of_the_repeats_with_its_spread() -> None:
    # two prompts of 10 tokens; repeat i: spec seconds summed over prompts / greedy seconds summed
    results = [_result(10, 1.0, 2, 2.0, [(1.5, 2.0), (0.5, 2.0)]),
               _result(10, 1.0, 1, 2.0, [(1.5, 2.0), (0.5, 2.0)])]
    o = build_report(results, 4)["overall"]
    # speedups: 4/2 = 2.0, 4/3 = 1.333, 4/1 = 4.0 -> median 2.0, spread 1.333-4.0
    assert o["timing_repeats"] == 3 and o["speedup"] == pytest.approx(2.0)
    assert o["speedup_spread"] == pytest.approx([4 / 3, 4.0])
    assert o["spec_tok_per_s"] == pytest.approx(10.0) and o["greedy_tok_per_s"] == pytest.approx(5.0)
    assert not o["speedup_is_noise"]
    line = next(x for x in summary_lines(build_report(results, 4)) if "speedup" in x)
    assert line.endswith("speedup 2.00x  (median of 3 timings, spread 1.33-4.00x)")


def test_with_no_accepted_draft_the_speedup_is_called_noise() -> None:
    results = [_result(10, 1.0, 0, 1.42, [])]  # tau 1.0, and a timing that says 1.42x
    report = build_report(results, 4)
    assert report["overall"]["tau"] == 1.0 and report["overall"]["speedup_is_noise"]
    lines = summary_lines(report)
    assert any(x.endswith("speedup 1.42x  (one timing, no spread)") for x in lines)
    assert ("no draft token was accepted (tau 1.000): speculative decoding cannot be faster than plain greedy "
            "here; a speedup above 1 is timing noise") in lines
    assert not any("timing noise" in x for x in summary_lines(build_report([_result(10, 1.0, 1, 1.4, [])], 4)))
