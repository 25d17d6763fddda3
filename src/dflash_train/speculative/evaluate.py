"""Evaluate a drafter on prompts by real speculative decoding, on the fast engine.

Used by `dflash-train eval`, the demo, and the trainer's checks on held-out prompts.
Everything runs in the target's dtype on the target's device (fp32 on CPU, bf16 on GPU by
default), through `make_spec_decoder`: the static-KV / CUDA-graph engine when it supports
the target, else the generic Hugging Face path.

* `evaluate_prompts`: batch 1, every prompt decoded plain greedy (the reference, with the
  target's top-1/top-2 margins) and speculatively; tau, speed, the lossless check.
* `measure_batched`: many prompts at once (committed tokens/s of a serving batch).
* `HeldOutProbe`: the trainer's measurement of tau on held-out prompts during training,
  on one engine that takes the drafter's current weights before each measurement.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from dflash_train.data.prompts import Prompt, encode_prompt
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.generate.decoder import UnsupportedModelError, check_supported
from dflash_train.speculative.decoders import (NEAR_TIE_ULPS, HFSpecDecoder, check_compatible, first_divergence,
                                               make_spec_decoder)
from dflash_train.speculative.engine import SpecEngine
from dflash_train.speculative.loop import DecodeResult
from dflash_train.speculative.metrics import (
    PromptResult,
    acceptance_stats,
    overall_report,
    prompt_report,
    repetition_rate,
    round_offsets,
    tau_by_position,
    tau_of,
)
from dflash_train.target.chat_template import stop_token_ids
from dflash_train.utils.errors import EvalError


def _cache_positions(prompts: Sequence[Sequence[int]], max_new_tokens: int, block_size: int) -> int:
    return max(len(p) for p in prompts) + max_new_tokens + block_size


def evaluate_prompts(
    target: torch.nn.Module,
    tokenizer,
    drafter: DFlashDrafter,
    prompts: list[Prompt],
    *,
    max_new_tokens: int = 256,
    greedy: bool = True,
    max_prompt_tokens: int | None = None,
    progress: bool = True,
    near_tie_ulps: float = NEAR_TIE_ULPS,
    cuda_graphs: bool = True,
    compile: bool = False,
    on_prompt: Callable[[PromptResult], None] | None = None,
    timing_repeats: int = 1,
    draft_window: int | None = None,
    slots: int = 1,
    overlap_rounds: bool = True,
) -> list[PromptResult]:
    """Speculative (and, if `greedy`, plain greedy) decoding of every prompt, batch 1; with
    `slots` > 1 (speculative only) `slots` prompts at once, for tau and the outputs (see
    `_evaluate_batched`).

    All CUDA graphs are captured and the first prompt is decoded once untimed in both modes
    first, so one-time costs land on neither side of the comparison. With `greedy`, each prompt
    is decoded `timing_repeats` times in both modes, back to back (a load spike hits both), and
    the speedup is reported per repeat (speculative/metrics.py: `_timed_speedup`). `draft_window`,
    `overlap_rounds`: SpecEngine's (a window for the drafter's full-attention layers; pipelined rounds)."""
    check_compatible(drafter, target)
    if slots > 1 and greedy:
        raise ValueError("decoding several prompts at once measures tau only: pass greedy=False")
    encoded = _encode_within(tokenizer, prompts, max_prompt_tokens)
    max_len = _cache_positions([ids for _, ids in encoded], max_new_tokens, drafter.config.block_size)
    decoder = make_spec_decoder(target, drafter, stop_token_ids(tokenizer, target), slots=slots, max_len=max_len,
                                cuda_graphs=cuda_graphs, compile=compile, draft_window=draft_window,
                                overlap_rounds=overlap_rounds)
    if slots > 1:
        return _evaluate_batched(decoder, encoded, max_new_tokens, max_len, slots)
    results: list[PromptResult] = []
    try:
        decoder.warm_up(max_len)
        warm = encoded[0][1]
        decoder.generate(warm, min(16, max_new_tokens))
        decoder.generate(warm, min(16, max_new_tokens), speculative=False)
        bar = tqdm(total=len(encoded), desc="eval prompts", unit="prompt", disable=not progress, dynamic_ncols=True)
        for prompt, ids in encoded:
            results.append(_evaluate_one(decoder, prompt, ids, max_new_tokens, greedy, near_tie_ulps, timing_repeats))
            if on_prompt is not None:
                on_prompt(results[-1])
            overall = overall_report(results, decoder.block_size)
            bar.set_postfix(tau=f"{overall['tau']:.2f}", **({"speedup": f"{overall['speedup']:.2f}x"} if greedy else {}))
            bar.update(1)
        bar.close()
    finally:
        _close(decoder)
    return results


def _encode_within(tokenizer, prompts: list[Prompt], max_prompt_tokens: int | None) -> list[tuple[Prompt, list[int]]]:
    """Each prompt with its token ids, those longer than `max_prompt_tokens` left out."""
    encoded = [(p, encode_prompt(tokenizer, p)) for p in prompts]
    if not encoded:
        raise EvalError("no prompt left to evaluate")
    kept = [(p, ids) for p, ids in encoded if len(ids) <= max_prompt_tokens] if max_prompt_tokens else encoded
    if not kept:
        shortest = min(len(ids) for _, ids in encoded)
        raise EvalError(f"no prompt left to evaluate: all {len(encoded)} are longer than --max-prompt-tokens "
                        f"{max_prompt_tokens} (the shortest has {shortest:,} tokens); raise it or give "
                        f"shorter prompts")
    return kept


def _evaluate_one(decoder, prompt: Prompt, ids: list[int], max_new_tokens: int, greedy: bool, near_tie_ulps: float,
                  timing_repeats: int) -> PromptResult:
    """One prompt at batch 1: plain greedy (if `greedy`) and speculative, then the timing repeats."""
    base = decoder.generate(ids, max_new_tokens, speculative=False) if greedy else None
    spec = decoder.generate(ids, max_new_tokens)
    div = first_divergence(spec.tokens, base, ulps=near_tie_ulps) if base is not None else None
    repeats = [(decoder.generate(ids, max_new_tokens).seconds,
                decoder.generate(ids, max_new_tokens, speculative=False).seconds)
               for _ in range(timing_repeats - 1 if greedy else 0)]
    return PromptResult(prompt.id, len(ids), spec, base, div, repeats)


def _evaluate_batched(decoder, encoded: list[tuple[Prompt, list[int]]], max_new_tokens: int, max_len: int,
                      slots: int) -> list[PromptResult]:
    """Every prompt through the decoder's slots at once (refilled as rows finish). Each prompt's
    drafts and verification are the same computation as at batch 1, so its outputs and rounds
    are batch 1's (exactly in fp32; in bf16 up to near-ties of the target's top two logits,
    where batched kernels round differently): tau in a fraction of the time. Its `seconds` are
    a shared batch's, not a batch-1 decode's."""
    try:
        decoder.warm_up(max_len)
        decoder.generate_batch([ids for _, ids in encoded[:slots]], min(16, max_new_tokens))  # untimed warm-up
        decoded = decoder.generate_batch([ids for _, ids in encoded], max_new_tokens)
    finally:
        _close(decoder)
    return [PromptResult(prompt.id, len(ids), spec) for (prompt, ids), spec in zip(encoded, decoded)]


def _close(decoder) -> None:
    if isinstance(decoder, HFSpecDecoder):
        decoder.close()  # its forward hooks on the target


def _batch_summary(results: list[DecodeResult], seconds: float, block_size: int) -> dict:
    tokens = sum(len(r.tokens) for r in results)
    rounds = [o for r in results for o in round_offsets(r.rounds)]
    return {"prompts": len(results), "tokens": tokens, "seconds": seconds, "committed_tok_per_s": tokens / seconds,
            **acceptance_stats([x for r in results for x in r.rounds], block_size), "tau": tau_of(rounds),
            "tau_by_position": tau_by_position(rounds),
            "repetition_rate": _mean([repetition_rate(r.tokens) for r in results])}


def measure_batched(target: torch.nn.Module, tokenizer, drafter: DFlashDrafter, prompts: list[Prompt], *,
                    slots: int, max_new_tokens: int, greedy: bool = True, cuda_graphs: bool = True,
                    compile: bool = False, draft_window: int | None = None, overlap_rounds: bool = True) -> dict:
    """Committed tokens/s of `slots` sequences decoded at once (slots refilled as they finish),
    speculative and, if `greedy`, plain greedy; after an untimed warm-up of every graph."""
    ids = [encode_prompt(tokenizer, p) for p in prompts]
    max_len = _cache_positions(ids, max_new_tokens, drafter.config.block_size)
    decoder = make_spec_decoder(target, drafter, stop_token_ids(tokenizer, target), slots=slots, max_len=max_len,
                                cuda_graphs=cuda_graphs, compile=compile, draft_window=draft_window,
                                overlap_rounds=overlap_rounds)
    out = {"slots": slots}
    try:
        decoder.warm_up(max_len)
        for mode in (["greedy"] if greedy else []) + ["spec"]:
            decoder.generate_batch(ids[:slots], min(16, max_new_tokens), speculative=mode == "spec")  # warm
            t0 = time.perf_counter()
            results = decoder.generate_batch(ids, max_new_tokens, speculative=mode == "spec")
            out[mode] = _batch_summary(results, time.perf_counter() - t0, decoder.block_size if mode == "spec" else 1)
    finally:
        _close(decoder)
    if greedy:
        out["speedup"] = out["spec"]["committed_tok_per_s"] / out["greedy"]["committed_tok_per_s"]
    return out


@dataclass
class HeldOutProbe:
    """tau of a drafter in training, measured by real speculative decoding of held-out prompts
    (token ids), batched. The engine (KV caches, CUDA graphs) is built on the first call and
    reused: each call first copies in the drafter's current weights."""

    target: torch.nn.Module
    stop_ids: set[int]
    prompts: list[list[int]]
    max_new_tokens: int = 128
    slots: int = 64
    cuda_graphs: bool = True
    engine: SpecEngine | None = None

    def available(self) -> bool:
        """Whether the static engine supports the target (the Hugging Face path cannot decode
        while a training target's hooks end its forwards early)."""
        try:
            check_supported(self.target)
        except UnsupportedModelError:
            return False
        return True

    @torch.no_grad()
    def measure(self, drafter: DFlashDrafter) -> dict:
        if self.engine is None:
            max_len = _cache_positions(self.prompts, self.max_new_tokens, drafter.config.block_size)
            self.engine = SpecEngine(self.target, drafter, self.stop_ids, slots=min(self.slots, len(self.prompts)),
                                     max_len=max_len, cuda_graphs=self.cuda_graphs)
        self.engine.refresh_drafter(drafter)
        t0 = time.perf_counter()
        results = self.engine.generate_batch(self.prompts, self.max_new_tokens)
        return _batch_summary(results, time.perf_counter() - t0, self.engine.block_size)


def build_report(results: list[PromptResult], block_size: int, **meta) -> dict:
    return {**meta, "block_size": block_size, "overall": overall_report(results, block_size),
            "per_prompt": [prompt_report(p, block_size) for p in results]}


def _mean(values: list[float]) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")
