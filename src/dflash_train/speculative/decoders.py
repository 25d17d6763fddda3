"""What evaluation calls around the speculative engine: the decoder for a target, and
whether a speculative output is lossless.

`make_spec_decoder` returns the static engine (speculative/engine.py) when it supports the
target (decoder.check_supported), else `HFSpecDecoder`: the generic Hugging Face path
(speculative/loop.py, batch 1) behind the same interface, `SpecDecoder`.

Lossless check. Speculative decoding is exact in exact arithmetic. In bf16 the verify
forward (B tokens, batched) and the greedy forward (1 token) run differently shaped
kernels, so the same logit comes out with different rounding; where the target's top two
logits are within that noise, the two runs may pick different tokens and then continue
differently. Such a divergence is expected; one at a clear margin is a bug. The plain
greedy run of the static engine records, for every token, the top-1 logit and its margin
over the top-2 (`DecodeResult.top_logits`, `.margins`); the margin at the first divergent
token decides:

    near_tie   margin <= tolerance (default: NEAR_TIE_ULPS units in the last place of bf16 at
               the top-1 logit's magnitude)
    mismatch   a larger margin, or no margin recorded there
"""

from __future__ import annotations

import copy
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from dflash_train.drafter.config import mismatches_with_target
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.generate.decoder import UnsupportedModelError, check_supported
from dflash_train.speculative.engine import SpecEngine
from dflash_train.speculative.hf_cache import decoding_cache
from dflash_train.speculative.loop import DecodeResult, DFlashProposer, SpeculativeDecoder
from dflash_train.utils.errors import ModelError

log = logging.getLogger(__name__)


class SpecDecoder(Protocol):
    """What evaluation calls on a decoder: the static engine and `HFSpecDecoder` are both one."""

    block_size: int  # tokens a speculative round proposes (1: no drafter)

    def warm_up(self, max_kv: int | None = None) -> None:
        """Compile or capture what a timed run would otherwise wait for, up to `max_kv` cache positions."""

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, speculative: bool = True) -> DecodeResult:
        """Greedy decoding of one prompt; speculative unless `speculative` is False."""

    def generate_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, speculative: bool = True,
                       on_result: Callable[[int, DecodeResult], None] | None = None) -> list[DecodeResult]:
        """Every prompt decoded; results in the prompts' order, each also given to `on_result` when it ends."""


def check_compatible(drafter: DFlashDrafter, target: torch.nn.Module) -> None:
    problems = mismatches_with_target(drafter.config, target.config)
    if problems:
        raise ModelError("the drafter does not fit this target: " + "; ".join(problems))


def make_proposer(drafter: DFlashDrafter, target: torch.nn.Module, *, copy_drafter: bool = False,
                  window: int | None = None) -> DFlashProposer:
    """The generic (Hugging Face path) proposer running `drafter` in the target's dtype and
    device (a copy if asked, so a training drafter is left untouched); `window`: DFlashProposer's."""
    check_compatible(drafter, target)
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    model = copy.deepcopy(drafter) if copy_drafter else drafter
    model = model.to(embed.device, embed.dtype).eval()
    return DFlashProposer(model, embed, head.weight if head is not None else embed, window=window)


class HFSpecDecoder:
    """The generic Hugging Face path (`SpeculativeDecoder` + `DFlashProposer`, batch 1) behind
    the engine's interface, for targets the static engine does not support."""

    def __init__(self, target: torch.nn.Module, drafter: DFlashDrafter | None, stop_ids: set[int] | Sequence[int],
                 draft_window: int | None = None):
        # (plain greedy needs no taps, but SpeculativeDecoder always taps some layer)
        self.decoder = SpeculativeDecoder(target, drafter.config.target_layer_ids if drafter else [0], stop_ids)
        self.proposer = None
        self.block_size = 1
        if drafter is not None:  # a copy: the proposer switches its module to eval mode, the caller's stays as it is
            self.proposer = make_proposer(drafter, target, copy_drafter=True, window=draft_window)
            self.block_size = drafter.config.block_size

    def warm_up(self, max_kv: int | None = None) -> None:
        pass

    def close(self) -> None:
        """Remove the forward hooks from the target."""
        self.decoder.close()

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, speculative: bool = True) -> DecodeResult:
        return self.decoder.generate(prompt_ids, max_new_tokens, self.proposer if speculative else None)

    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        speculative: bool = True,
        on_result: Callable[[int, DecodeResult], None] | None = None,
    ) -> list[DecodeResult]:
        results = []
        for i, p in enumerate(prompts):
            results.append(self.generate(p, max_new_tokens, speculative=speculative))
            if on_result is not None:
                on_result(i, results[-1])
        return results


def _hf_path_cost(target: torch.nn.Module) -> str:
    """What the Hugging Face path costs on `target`, as measured (bench/family_eval.py, one H200)."""
    cost = ("measured at a tenth of the weights' bandwidth bound (a Gemma-3-27B-shaped target: 8.5 tok/s plain "
            "greedy in bf16 on an H200)")
    if decoding_cache(target) is None:  # recurrent layers: rolled back by a replay forward (hf_cache.py)
        cost += ("; its recurrent layers are rolled back by running the accepted tokens again, which costs about "
                 "one more verify forward on every round that rejects a draft")
    return cost


def make_spec_decoder(
    target: torch.nn.Module,
    drafter: DFlashDrafter | None,
    stop_ids: set[int] | Sequence[int],
    *,
    slots: int = 1,
    max_len: int = 2048,
    **engine_kwargs: Any,
) -> SpecDecoder:
    """The static engine when it supports `target` (decoder.check_supported), else the
    generic Hugging Face path."""
    try:
        check_supported(target)
    except UnsupportedModelError as exc:
        log.warning("static speculative engine unavailable (%s); using the Hugging Face path: batch 1, no CUDA "
                    "graphs, %s (docs/eval.md, \"Supported models\")", exc, _hf_path_cost(target))
        return HFSpecDecoder(target, drafter, stop_ids, engine_kwargs.get("draft_window"))
    return SpecEngine(target, drafter, stop_ids, slots=slots, max_len=max_len, **engine_kwargs)


# bf16 keeps 8 significant bits: numbers in [2^e, 2^(e+1)) are 2^(e-7) apart (1/8 at 16..32).
BF16_SIGNIFICANT_BITS = 8
# Default near-tie bound, in bf16 ulps at the top-1 logit. Why 4: each of the two logits is its
# own bf16 rounding (<= 0.5 ulp off), so the output rounding alone can swap logits up to
# 1 ulp apart. Upstream, the hidden state entering the LM head is bf16 too (2^-9 relative per
# rounding) and comes out of 30-ish layers whose matmuls accumulate in a different order when
# the forward's shape differs (B-token verify vs 1-token greedy, 64 slots vs 1); that moves a
# logit of ~20 by about 0.1-0.3, i.e. 1-3 ulps more (an estimate: the bench reports the margin
# at every divergence, so the default can be checked against data). A real bug (wrong mask,
# position, stale cache entry) changes logits by whole units: 8+ ulps at |x| >= 16, more below.
NEAR_TIE_ULPS = 4.0


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
