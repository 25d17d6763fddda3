"""Learning-rate schedule: linear warmup, then cosine decay to lr * min_lr_ratio."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base lr for optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine(optimizer: torch.optim.Optimizer, *, warmup: int, total: int, min_ratio: float):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, warmup=warmup, total=total, min_ratio=min_ratio)
    )
