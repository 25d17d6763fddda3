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
* tau by position: rounds grouped by where their anchor (the last committed token) sits in
  the answer, offset 0 = the first new token: buckets 0-127, 128-255, ... Later answer
  tokens of small models repeat themselves more, and are easier to draft.
* repetition rate: the share of a text's n-grams (n = 6) that already occurred earlier in it.
* the teacher-forced walk (`walk_rounds`): given the drafts a round anchored at each answer
  offset would accept (measured teacher-forced on the answer text), the rounds speculative
  decoding of that text would make: anchor 0, then anchor + accepted + 1, ... Its tau
  predicts the measured one; the plain mean over all anchors does not (decoding jumps over
  the easy stretches, so it visits hard positions more often: it is a harmonic mean).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from dflash_train.speculative.decoders import Divergence
from dflash_train.speculative.loop import DecodeResult, Round

BUCKET = 128  # answer tokens per position bucket
REPEAT_NGRAM = 6


def repetition_rate(tokens: Sequence[int], n: int = REPEAT_NGRAM) -> float:
    """Share of the n-grams of `tokens` that occur earlier in `tokens` (nan if it has none)."""
    seen: set[tuple[int, ...]] = set()
    repeats = total = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        repeats += gram in seen
        total += 1
        seen.add(gram)
    return repeats / total if total else float("nan")


def round_offsets(rounds: Sequence[Round]) -> list[tuple[int, int]]:
    """(answer offset of the round's anchor, tokens committed) of each round of one output."""
    out, offset = [], 0
    for r in rounds:
        out.append((offset, r.committed))
        offset += r.committed
    return out


def walk_rounds(accepted: Sequence[int], limit: int | None = None) -> list[tuple[int, int]]:
    """The rounds speculative decoding makes over an answer whose round anchored at offset i
    accepts accepted[i] drafts (len(accepted) = answer tokens that can anchor a round: all
    but the last). Rounds start at offsets < `limit` (the measured run's max_new_tokens - 1)."""
    end = len(accepted) if limit is None else min(len(accepted), limit)
    out, offset = [], 0
    while offset < end:
        committed = min(int(accepted[offset]) + 1, len(accepted) - offset)  # the answer ends there
        out.append((offset, committed))
        offset += committed
    return out


def tau_by_position(rounds: Iterable[tuple[int, int]], bucket: int = BUCKET) -> dict[str, float]:
    """tau per bucket of anchor offsets, {"0-127": tau, "128-255": tau, ...}."""
    committed: dict[int, int] = {}
    count: dict[int, int] = {}
    for offset, c in rounds:
        b = offset // bucket
        committed[b] = committed.get(b, 0) + c
        count[b] = count.get(b, 0) + 1
    return {f"{b * bucket}-{(b + 1) * bucket - 1}": committed[b] / count[b] for b in sorted(count)}


def tau_of(rounds: Sequence[tuple[int, int]]) -> float:
    return sum(c for _, c in rounds) / len(rounds) if rounds else float("nan")


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
    divergence: Divergence | None = None  # of spec from greedy, with the target's margin there
    # (spec seconds, greedy seconds) of each timing repeat after the first run (eval --timing-repeats)
    repeats: list[tuple[float, float]] = field(default_factory=list)

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
           "tau_by_position": tau_by_position(round_offsets(p.spec.rounds)),
           "repetition_rate": repetition_rate(p.spec.tokens),
           "spec_seconds": p.spec.seconds, "spec_tok_per_s": _speed(p.spec), "prefill_seconds": p.spec.prefill_seconds,
           "draft_seconds": p.spec.draft_seconds, "verify_seconds": p.spec.verify_seconds}
    if p.greedy is not None:
        out.update(greedy_seconds=p.greedy.seconds, greedy_tok_per_s=_speed(p.greedy),
                   speedup=_speed(p.spec) / _speed(p.greedy),
                   matches_greedy=p.matches_greedy, first_mismatch=p.first_mismatch())
    if p.divergence is not None:
        out["divergence"] = dict(p.divergence.__dict__)
    return out


def overall_report(results: list[PromptResult], block_size: int) -> dict:
    """Totals over prompts: rounds pooled (so tau weights prompts by their length), speeds
    from summed tokens and summed seconds."""
    rounds = [r for p in results for r in p.spec.rounds]
    new_tokens = sum(len(p.spec.tokens) for p in results)
    spec_s = sum(p.spec.seconds for p in results)
    out = {"prompts": len(results), "new_tokens": new_tokens, **acceptance_stats(rounds, block_size),
           "tau_by_position": tau_by_position(o for p in results for o in round_offsets(p.spec.rounds)),
           "repetition_rate": _mean([r for p in results if (r := repetition_rate(p.spec.tokens)) == r]),
           "tau_mean_of_prompts": _mean([p.spec.tau for p in results if p.spec.rounds]),
           "spec_seconds": spec_s, "spec_tok_per_s": new_tokens / spec_s if spec_s > 0 else float("nan"),
           "draft_seconds": sum(p.spec.draft_seconds for p in results),
           "verify_seconds": sum(p.spec.verify_seconds for p in results)}
    replays = [p.spec.replay for p in results if p.spec.replay is not None]
    if replays:  # the Hugging Face path on recurrent layers (speculative/hf_cache.py)
        out["replay"] = {"rounds": sum(r.replays for r in replays), "tokens": sum(r.replayed_tokens for r in replays),
                         "of_rounds": len(rounds)}
    with_greedy = [p for p in results if p.greedy is not None]
    if with_greedy:
        out.update(_timed_speedup(with_greedy), matches_greedy=sum(bool(p.matches_greedy) for p in with_greedy),
                   mismatched_ids=[p.id for p in with_greedy if not p.matches_greedy])
        kinds = [p.divergence.kind for p in with_greedy if p.divergence is not None]
        out["divergences"] = {k: kinds.count(k) for k in ("identical", "near_tie", "mismatch")}
    return out


def _timed_speedup(results: list[PromptResult]) -> dict:
    """Speeds and speedup of the prompts that were also decoded plain greedy. Each timing repeat
    (the first run and `repeats`) gives one speedup from its summed seconds; the report holds their
    median, the spread (min, max), and the median speeds. With no accepted draft (tau 1.0) no
    speedup can be real: speculation only added work, and a ratio above 1 is timing noise."""
    n = 1 + min(len(p.repeats) for p in results)
    spec_tokens = sum(len(p.spec.tokens) for p in results)
    greedy_tokens = sum(len(p.greedy.tokens) for p in results)
    runs = [[(p.spec.seconds, p.greedy.seconds), *p.repeats][:n] for p in results]
    spec_speeds = [_rate(spec_tokens, sum(r[i][0] for r in runs)) for i in range(n)]
    greedy_speeds = [_rate(greedy_tokens, sum(r[i][1] for r in runs)) for i in range(n)]
    speedups = [s / g for s, g in zip(spec_speeds, greedy_speeds)]
    accepted = sum(r.accepted for p in results for r in p.spec.rounds)
    return {"greedy_seconds": sum(p.greedy.seconds for p in results),
            "greedy_tok_per_s": statistics.median(greedy_speeds), "spec_tok_per_s": statistics.median(spec_speeds), "speedup": statistics.median(speedups),
            "speedup_spread": [min(speedups), max(speedups)], "timing_repeats": n, "speedup_is_noise": accepted == 0}


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("nan")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
