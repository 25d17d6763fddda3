"""Evaluate a drafter on a prompt set: speculative and plain greedy decoding of every prompt.

Used by `dflash-train eval`, the demo, and the trainer's end-of-run check
(`speculative_tau`). Everything runs in the target's dtype on the target's device
(fp32 on CPU, bf16 on GPU by default).
"""

from __future__ import annotations

import copy
import os
import sys
import time
from typing import Callable

import torch

from dflash_train.drafter.model import DFlashDrafter
from dflash_train.eval.metrics import PromptResult, overall_report, prompt_report
from dflash_train.eval.prompts import Prompt, encode_prompt
from dflash_train.generate.speculative import DFlashProposer, SpeculativeDecoder


class EvalError(ValueError):
    """A drafter that does not fit the target, or prompts that cannot be used."""


def busy_cores_elsewhere(window_s: float = 0.5) -> float | None:
    """Cores kept busy by other processes right now (Linux /proc/stat), or None if unknown."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:9]]
        return sum(values), values[3] + values[4]  # total, idle + iowait (jiffies over all cores)

    try:
        total0, idle0 = sample()
        self0 = sum(os.times()[:2])
        time.sleep(window_s)
        total1, idle1 = sample()
        self1 = sum(os.times()[:2])
    except (OSError, ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    if total1 <= total0:
        return None
    busy = cores * (1 - (idle1 - idle0) / (total1 - total0))  # cores busy on the whole machine
    return max(0.0, busy - (self1 - self0) / window_s)


def choose_cpu_threads(requested: int = 0) -> tuple[int, str]:
    """Torch CPU threads: `requested`, or (0) as many cores as other processes leave idle.

    OpenMP threads wait for each other at every parallel region: when another process
    holds one of the cores, a 2-thread matmul ran 10-30x slower than a 1-thread one on a
    shared 2-core machine. So the threads are fitted to the cores idle right now.
    """
    if requested:
        torch.set_num_threads(requested)
        return requested, "as requested"
    cores = torch.get_num_threads()
    busy = busy_cores_elsewhere()
    if busy is None:
        return cores, "default"
    free = max(1, min(cores, int(cores - busy + 0.5)))
    if free < cores:
        torch.set_num_threads(free)
        return free, f"other processes keep {busy:.1f} of {cores} cores busy; --threads overrides"
    return cores, "all cores idle"


def stop_tokens(tokenizer, model) -> set[int]:
    """EOS of the tokenizer and generation config, plus the chat template's end of turn."""
    from dflash_train.generate.builtin import stop_token_ids

    return stop_token_ids(tokenizer, model)


def check_compatible(drafter: DFlashDrafter, target: torch.nn.Module) -> None:
    cfg = drafter.config
    text_cfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    embed = target.get_input_embeddings().weight
    problems = []
    if cfg.hidden_size != embed.shape[1]:
        problems.append(f"hidden size {cfg.hidden_size} != target's {embed.shape[1]}")
    if cfg.num_target_layers != text_cfg.num_hidden_layers:
        problems.append(f"trained for a target with {cfg.num_target_layers} layers, this one has "
                        f"{text_cfg.num_hidden_layers}")
    if cfg.mask_token_id >= embed.shape[0]:
        problems.append(f"mask token {cfg.mask_token_id} is outside the target's embedding ({embed.shape[0]} rows)")
    if problems:
        raise EvalError("the drafter does not fit this target: " + "; ".join(problems))


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
    stop = stop_tokens(tokenizer, target)
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
    from tqdm.auto import tqdm

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
