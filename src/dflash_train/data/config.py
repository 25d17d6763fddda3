"""`data:` section of the training config: the dataset, its evaluation split, the batch plan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflash_train.data.batching import BatchPlanConfig


@dataclass
class DataConfig:
    path: str = ""
    """a dataset directory written by `dflash-train prepare` (or synthetic:N:LEN for benchmarks)"""
    eval_path: str | None = None
    """a separate prepared dataset for evaluation"""
    eval_fraction: float = 0.0
    """or hold out this fraction of `path` (deterministic by run.seed)"""
    eval_split: Literal["prompt", "row"] = "prompt"
    """how eval_fraction holds out: whole prompts, minus near-duplicates of training rows (prompt), or random rows (row)"""
    # 0.5 on 3-grams, with n-grams found in >5% of training prompts/answers (template, system
    # prompt) left out: on the shipped SmolLM2 chats a one-word edit of a ~12-token request scores
    # 0.57-0.71 and a rewording 0.38, different requests sharing a phrasing at most 0.27 (5-grams
    # score that one-word edit 0.44 and would keep it). Lower thresholds make LSH much slower.
    dedup_threshold: float = 0.5
    """drop eval rows whose prompt or answer has Jaccard >= this with a training row's (token n-grams); 0 = off"""
    dedup_ngram: int = 3
    """n of the token n-grams that near-duplicates are compared on"""
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
        if self.eval_split not in ("prompt", "row"):
            raise ValueError(f"data.eval_split must be prompt or row, got {self.eval_split!r}")
        if not 0.0 <= self.dedup_threshold <= 1.0:
            raise ValueError(f"data.dedup_threshold must be in [0, 1] (0 = no near-duplicate check), got {self.dedup_threshold}")
        if not 1 <= self.dedup_ngram <= 64:
            raise ValueError(f"data.dedup_ngram must be in [1, 64], got {self.dedup_ngram}")
        if self.prefetch < 1 or self.eval_batches < 0:
            raise ValueError("data.prefetch must be >= 1 and data.eval_batches >= 0")
