"""Evaluate a drafter on a prompt set: speculative and plain greedy decoding of every prompt.

Used by `dflash-train eval`, the demo, and the trainer's end-of-run check
(`speculative_tau`). Everything runs in the target's dtype on the target's device
(fp32 on CPU, bf16 on GPU by default).
"""

from __future__ import annotations

import copy
import sys
import time
from typing import Callable

import torch
from tqdm.auto import tqdm

from dflash_train.data.prompts import Prompt, encode_prompt
from dflash_train.drafter.config import mismatches_with_target
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.generate.spec_metrics import PromptResult, overall_report, prompt_report
from dflash_train.generate.speculative import DFlashProposer, SpeculativeDecoder
from dflash_train.target.chat_template import stop_token_ids
from dflash_train.utils.errors import EvalError, ModelError


def check_compatible(drafter: DFlashDrafter, target: torch.nn.Module) -> None:
    problems = mismatches_with_target(drafter.config, target.config)
    if problems:
        raise ModelError("the drafter does not fit this target: " + "; ".join(problems))


def make_proposer(drafter: DFlashDrafter, target: torch.nn.Module, *, copy_drafter: bool = False) -> DFlashProposer:
    """A proposer running `drafter` in the target's dtype and device (a copy if asked, so a
    training drafter is left untouched)."""
    check_compatible(drafter, target)
    embed = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    model = copy.deepcopy(drafter) if copy_drafter else drafter
    model = model.to(embed.device, embed.dtype).eval()
    return DFlashProposer(model, embed, head.weight if head is not None else embed)


def evaluate_prompts(
    target: torch.nn.Module,
    tokenizer,
    proposer: DFlashProposer,
    prompts: list[Prompt],
    *,
    max_new_tokens: int = 256,
    greedy: bool = True,
    max_prompt_tokens: int | None = None,
    progress: bool = True,
    on_prompt: Callable[[PromptResult], None] | None = None,
) -> list[PromptResult]:
    """Speculative (and, if `greedy`, plain greedy) decoding of every prompt.

    The first prompt is decoded once untimed in both modes first, so one-time costs
    (allocator growth, kernel selection) do not land on either side of the comparison.
    """
    encoded = [(p, encode_prompt(tokenizer, p)) for p in prompts]
    if max_prompt_tokens:
        encoded = [(p, ids) for p, ids in encoded if len(ids) <= max_prompt_tokens]
    if not encoded:
        raise EvalError("no prompt left to evaluate")
    stop = stop_token_ids(tokenizer, target)
    results: list[PromptResult] = []
    layer_ids = proposer.cfg.target_layer_ids
    with SpeculativeDecoder(target, layer_ids, stop) as decoder:
        warm_ids = encoded[0][1]
        decoder.generate(warm_ids, min(16, max_new_tokens), proposer)
        decoder.generate(warm_ids, min(16, max_new_tokens))
        bar = _progress(len(encoded), progress)
        for prompt, ids in encoded:
            base = decoder.generate(ids, max_new_tokens) if greedy else None
            spec = decoder.generate(ids, max_new_tokens, proposer)
            result = PromptResult(prompt.id, len(ids), spec, base)
            results.append(result)
            if on_prompt is not None:
                on_prompt(result)
            if bar is not None:
                overall = overall_report(results, proposer.block_size)
                bar.set_postfix(tau=f"{overall['tau']:.2f}", **({"speedup": f"{overall['speedup']:.2f}x"}
                                                                 if greedy else {}))
                bar.update(1)
        if bar is not None:
            bar.close()
    return results


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    return tqdm(total=total, desc="eval prompts", unit="prompt", file=sys.stderr, dynamic_ncols=True)


def build_report(results: list[PromptResult], block_size: int, **meta) -> dict:
    return {**meta, "block_size": block_size, "overall": overall_report(results, block_size),
            "per_prompt": [prompt_report(p, block_size) for p in results]}


def speculative_tau(
    target: torch.nn.Module,
    tokenizer,
    drafter: DFlashDrafter,
    prompts: list[Prompt],
    *,
    max_new_tokens: int = 128,
    greedy: bool = False,
    progress: bool = False,
) -> dict:
    """`tau` (and acceptance) of `drafter` measured by real speculative decoding: the call
    the trainer makes at the end of a run. The training drafter is copied, not modified."""
    t0 = time.perf_counter()
    proposer = make_proposer(drafter, target, copy_drafter=True)
    results = evaluate_prompts(target, tokenizer, proposer, prompts, max_new_tokens=max_new_tokens,
                               greedy=greedy, progress=progress)
    report = overall_report(results, proposer.block_size)
    report["seconds"] = time.perf_counter() - t0
    return report
