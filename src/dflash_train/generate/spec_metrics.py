"""Acceptance and speed metrics of speculative decoding, per prompt and overall.

Definitions (docs/eval.md):

* a round is one target verify forward after the prefill. In it the drafter's `d` drafts
  (d = B-1, fewer only near max_new_tokens) are checked; `a` = the longest prefix equal to
  the target's greedy choices (0..d); the round commits `a + 1` tokens (the accepted drafts
  plus the target's bonus token), fewer only when a stop token or the token limit ends the
  output inside the round.
* `tau` = committed tokens / rounds: tokens per target forward (the spec's acceptance
  length; 1.0 for plain greedy decoding).
* `accept_hist[a]` = rounds that accepted exactly `a` drafts, a = 0..B-1 (committed = a + 1).
* `accept_rate[k-1]` (slot k = 1..B-1): fraction of rounds that drafted slot k in which it
  was accepted (unconditional: P(a >= k)); `accept_rate_cond[k-1]`: the same among rounds
  that accepted every slot before k (P(a >= k | a >= k-1)).
* tokens/s: new tokens / wall time of the whole generation, prefill included, for the
  speculative and the plain greedy run of the same prompt; speedup = their ratio (the
  time ratio when both outputs are equal, as they must be in fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from dflash_train.generate.speculative import DecodeResult, Round


def acceptance_stats(rounds: Iterable[Round], block_size: int) -> dict:
    rounds = list(rounds)
    slots = block_size - 1
    hist = [0] * block_size
    reached = [0] * (slots + 1)  # reached[k]: rounds with a >= k and d >= k (k = 0 counts all rounds)
    tried = [0] * (slots + 1)  # rounds with d >= k
    prev_ok = [0] * (slots + 1)  # rounds with a >= k - 1 and d >= k
    for r in rounds:
        hist[min(r.accepted, slots)] += 1
        for k in range(1, min(r.drafted, slots) + 1):
            tried[k] += 1
            if r.accepted >= k - 1:
                prev_ok[k] += 1
            if r.accepted >= k:
                reached[k] += 1
    committed = sum(r.committed for r in rounds)
    n = len(rounds)
    return {
        "rounds": n,
        "committed": committed,
        "tau": committed / n if n else float("nan"),
        "accept_hist": hist,
        "accept_rate": [reached[k] / tried[k] if tried[k] else float("nan") for k in range(1, slots + 1)],
        "accept_rate_cond": [reached[k] / prev_ok[k] if prev_ok[k] else float("nan") for k in range(1, slots + 1)],
    }


@dataclass
class PromptResult:
    """The speculative and the plain greedy run of one prompt."""

    id: str
    prompt_tokens: int
    spec: DecodeResult
    greedy: DecodeResult | None = None

    @property
    def matches_greedy(self) -> bool | None:
        return None if self.greedy is None else self.spec.tokens == self.greedy.tokens

    def first_mismatch(self) -> int | None:
        if self.greedy is None:
            return None
        for i, (a, b) in enumerate(zip(self.spec.tokens, self.greedy.tokens)):
            if a != b:
                return i
        n, m = len(self.spec.tokens), len(self.greedy.tokens)
        return None if n == m else min(n, m)


def _speed(result: DecodeResult) -> float:
    return len(result.tokens) / result.seconds if result.seconds > 0 else float("nan")



def prompt_report(p: PromptResult, block_size: int) -> dict:
    out = {"id": p.id, "prompt_tokens": p.prompt_tokens, "new_tokens": len(p.spec.tokens),
           "finish_reason": p.spec.finish_reason, **acceptance_stats(p.spec.rounds, block_size),
           "spec_seconds": p.spec.seconds, "spec_tok_per_s": _speed(p.spec), "prefill_seconds": p.spec.prefill_seconds,
           "draft_seconds": p.spec.draft_seconds, "verify_seconds": p.spec.verify_seconds}
    if p.greedy is not None:
        out.update(greedy_seconds=p.greedy.seconds, greedy_tok_per_s=_speed(p.greedy),
                   speedup=_speed(p.spec) / _speed(p.greedy),
                   matches_greedy=p.matches_greedy, first_mismatch=p.first_mismatch())
    return out


def overall_report(results: list[PromptResult], block_size: int) -> dict:
    """Totals over prompts: rounds pooled (so tau weights prompts by their length), speeds
    from summed tokens and summed seconds."""
    rounds = [r for p in results for r in p.spec.rounds]
    new_tokens = sum(len(p.spec.tokens) for p in results)
    spec_s = sum(p.spec.seconds for p in results)
    out = {"prompts": len(results), "new_tokens": new_tokens, **acceptance_stats(rounds, block_size),
           "tau_mean_of_prompts": _mean([p.spec.tau for p in results if p.spec.rounds]),
           "spec_seconds": spec_s, "spec_tok_per_s": new_tokens / spec_s if spec_s > 0 else float("nan"),
           "draft_seconds": sum(p.spec.draft_seconds for p in results),
           "verify_seconds": sum(p.spec.verify_seconds for p in results)}
    with_greedy = [p for p in results if p.greedy is not None]
    if with_greedy:
        greedy_s = sum(p.greedy.seconds for p in with_greedy)
        greedy_tokens = sum(len(p.greedy.tokens) for p in with_greedy)
        spec_s_same = sum(p.spec.seconds for p in with_greedy)
        spec_speed = sum(len(p.spec.tokens) for p in with_greedy) / spec_s_same if spec_s_same > 0 else float("nan")
        greedy_speed = greedy_tokens / greedy_s if greedy_s > 0 else float("nan")
        out.update(greedy_seconds=greedy_s, greedy_tok_per_s=greedy_speed, speedup=spec_speed / greedy_speed,
                   matches_greedy=sum(bool(p.matches_greedy) for p in with_greedy),
                   mismatched_ids=[p.id for p in with_greedy if not p.matches_greedy])
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
