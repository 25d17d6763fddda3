"""Measuring the drafter during and after training.

* `evaluate_split`: the eval split, teacher-forced with the target's own greedy labels:
  tau here estimates speculative-decoding acceptance, cheaply, at any step;
* `speculative_check`: tau measured by real speculative decoding on held-out prompts
  (generate/spec_eval.py), next to the estimate.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dflash_train.data.prompts import load_prompts
from dflash_train.data.splits import DataSplits
from dflash_train.drafter.loss import LossConfig, summarize
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.drafter.step import FrozenHeads, StepConfig
from dflash_train.generate.spec_eval import speculative_tau
from dflash_train.target.runner import TargetRunner
from dflash_train.train.config import EvalConfig
from dflash_train.train.step import batch_seed, micro_step
from dflash_train.train.timing import StageTimer

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate_split(drafter: DFlashDrafter, heads: FrozenHeads, runner: TargetRunner, data: DataSplits, *,
                   step_cfg: StepConfig, loss_cfg: LossConfig, device: torch.device, seed: int,
                   max_batches: int, num_drafters: int = 1, pad=lambda batch: batch) -> dict:
    """Metrics of the eval split with `target` labels (no noise); {} without an eval split.
    Anchors are drawn as for batch `index * num_drafters` (the main drafter's numbering)."""
    if data.eval is None:
        return {}
    was_training = drafter.training
    drafter.eval()
    eval_cfg = dataclasses.replace(step_cfg, label_source="target", noise_sigma=0.0)
    timer = StageTimer(device)
    stats = []
    for i, batch in enumerate(data.eval_planner.iter_batches(data.eval, start=(0, 0), epochs=1)):
        if max_batches and i >= max_batches:
            break
        batch = pad(batch)
        target_out = runner.run_batch(batch, device, need_final=True)
        stats.append(micro_step(drafter, heads, batch, target_out, step_cfg=eval_cfg, loss_cfg=loss_cfg,
                                device=device, seed=batch_seed(seed, batch.epoch, batch.index * num_drafters, stream=1),
                                timer=timer, train=False))
    drafter.train(was_training)
    return summarize(stats) if stats else {}


def speculative_check(target: torch.nn.Module, tokenizer, drafter: DFlashDrafter, cfg: EvalConfig, *,
                      progress: bool) -> dict:
    """tau by real speculative decoding on `cfg.spec_prompts` (the drafter is copied, not changed)."""
    log.info("speculative decoding on %s prompts of %s ...", cfg.spec_num_prompts or "all", cfg.spec_prompts)
    prompts = load_prompts(cfg.spec_prompts, cfg.spec_num_prompts or None)
    m = speculative_tau(target, tokenizer, drafter, prompts, max_new_tokens=cfg.spec_max_new_tokens,
                        progress=progress)
    keep = {k: m[k] for k in ("tau", "prompts", "rounds", "new_tokens", "seconds")}
    keep.update({f"accept_rate_{k + 1}": v for k, v in enumerate(m["accept_rate"])})
    return keep
