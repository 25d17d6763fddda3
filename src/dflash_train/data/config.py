"""`data:` section of the training config: the dataset, its evaluation split, the batch plan."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_train.data.batching import BatchPlanConfig


@dataclass
class DataConfig:
    path: str = ""
    """a dataset directory written by `dflash-train prepare` (or synthetic:N:LEN for benchmarks)"""
    eval_path: str | None = None
    """a separate prepared dataset for evaluation"""
    eval_fraction: float = 0.0
    """or hold out this fraction of `path` (deterministic by run.seed)"""
    eval_batches: int = 20
    """batches per evaluation (0 = the whole eval split)"""
    plan: BatchPlanConfig = field(default_factory=BatchPlanConfig)
    prefetch: int = 2
    """batches prepared ahead by the loader thread"""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_path and self.eval_fraction:
            raise ValueError("give data.eval_path or data.eval_fraction, not both")
        if self.prefetch < 1 or self.eval_batches < 0:
            raise ValueError("data.prefetch must be >= 1 and data.eval_batches >= 0")
