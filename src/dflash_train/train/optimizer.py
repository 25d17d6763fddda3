"""The optimizer and its learning-rate schedule: AdamW, linear warmup, cosine decay."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dflash_train.train.config import OptimConfig


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """Fused AdamW on every device (CPU and CUDA both have the kernel): one multi-tensor pass,
    and it divides the gradients by `grad_scale` inside that pass (train/step.py uses this for
    the global normalisation and the clip, instead of two more passes over the gradients)."""
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             weight_decay=cfg.weight_decay, fused=True)


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: Callable[[], int]):
    """`total_steps` is read at every step: run.fit_schedule may shorten the schedule once, mid-run."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup=cfg.warmup_steps, total=total_steps(), min_ratio=cfg.min_lr_ratio))
