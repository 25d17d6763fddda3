"""Is a speculative output lossless? Where it first differs from plain greedy decoding, and
whether the target's choice there was a near-tie that bf16 rounding can flip.

Speculative decoding is exact in exact arithmetic. In bf16 the verify forward (B tokens,
batched) and the greedy forward (1 token) run differently shaped kernels, so the same logit
comes out with different rounding; where the target's top two logits are within that
noise, the two runs may pick different tokens and then continue differently. Such a
divergence is expected; one at a clear margin is a bug.

The plain greedy run of the static engine records, for every token, the top-1 logit and its
margin over the top-2 (`DecodeResult.top_logits`, `.margins`). The margin at the first
divergent token decides:

    near_tie   margin <= tolerance (default: NEAR_TIE_ULPS units in the last place of bf16 at
               the top-1 logit's magnitude)
    mismatch   a larger margin, or no margin recorded there
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from dflash_train.generate.speculative import DecodeResult

# bf16 keeps 8 significant bits: numbers in [2^e, 2^(e+1)) are 2^(e-7) apart.
BF16_SIGNIFICANT_BITS = 8
# Each of the two logits is its own bf16 rounding (<= 0.5 ulp off), so an order swap needs a
# margin <= 1 ulp from the output rounding alone; the differently shaped verify forward also
# perturbs the fp32 value before that rounding (its bf16 hidden states round differently),
# by about as much again. 2 ulps covers both while staying far below the margins at which a
# wrong mask, position or cache entry shows (typically whole logits, i.e. 8+ ulps at |x| ~ 16).
NEAR_TIE_ULPS = 2.0


def bf16_ulp(x: float) -> float:
    """Distance between adjacent bf16 numbers at |x| (the spacing of its binade)."""
    if x == 0 or not math.isfinite(x):
        return 0.0
    _, e = math.frexp(abs(x))  # |x| = m * 2^e with 0.5 <= m < 1, so |x| is in [2^(e-1), 2^e)
    return 2.0 ** (e - BF16_SIGNIFICANT_BITS)


@dataclass
class Divergence:
    position: int | None  # index of the first differing new token; None: identical outputs
    margin: float | None  # the greedy reference's top-1 minus top-2 logit there
    tolerance: float | None  # the near-tie bound used there
    kind: str  # "identical", "near_tie" or "mismatch"


def first_divergence(
    tokens: Sequence[int], reference: DecodeResult, *, ulps: float = NEAR_TIE_ULPS, tolerance: float | None = None
) -> Divergence:
    """Compare new tokens `tokens` (e.g. a speculative run's) with a plain greedy `reference`
    that recorded margins. `tolerance` (logit units) overrides the bf16-relative default."""
    ref = reference.tokens
    position = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), None)
    if position is None:
        if len(tokens) == len(ref):
            return Divergence(None, None, None, "identical")
        # One stopped where the other went on with the same tokens: a stopping bug, never a tie.
        return Divergence(min(len(tokens), len(ref)), None, None, "mismatch")
    margins, tops = reference.margins or [], reference.top_logits or []
    if position >= len(margins):
        return Divergence(position, None, None, "mismatch")
    margin = margins[position]
    if tolerance is None:
        top = tops[position] if position < len(tops) else margin
        tolerance = ulps * bf16_ulp(top)
    return Divergence(position, margin, tolerance, "near_tie" if margin <= tolerance else "mismatch")
