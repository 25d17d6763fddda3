"""The datasets a run reads: open and check them, split off the evaluation set, plan batches.

Nothing here loads a model: every problem with the data is found before the target loads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_train.data.batching import BatchPlanner
from dflash_train.data.config import DataConfig
from dflash_train.data.dataset import TokenDataset
from dflash_train.data.synthetic import SyntheticDataset, is_synthetic
from dflash_train.utils.errors import ConfigError, DataError


class IndexSubset:
    """A view of some samples of a dataset (train/eval split) with the Dataset interface."""

    def __init__(self, dataset, indices: np.ndarray):
        self.dataset, self.indices = dataset, np.asarray(indices, dtype=np.int64)
        self.lengths = np.asarray(dataset.lengths)[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.dataset[int(self.indices[i])]


@dataclass
class DataSplits:
    train: Any  # TokenDataset, SyntheticDataset or IndexSubset of one
    eval: Any | None
    planner: BatchPlanner  # of `train`
    eval_planner: BatchPlanner | None  # of `eval`, never shuffled


def _open(path: str, *, vocab_size: int, seed: int, tokenizer_identity: dict | None):
    dataset = SyntheticDataset(path, vocab_size=vocab_size, seed=seed) if is_synthetic(path) else TokenDataset(path)
    if len(dataset) == 0:
        raise DataError(path, None, None, "the dataset is empty (0 samples): check the prepare manifest")
    if tokenizer_identity is not None and not is_synthetic(path):
        dataset.check_tokenizer(tokenizer_identity)
    return dataset


def open_data(cfg: DataConfig, *, seed: int, vocab_size: int, tokenizer_identity: dict | None) -> DataSplits:
    """Open and check the datasets (against the target's tokenizer fingerprint when given),
    split off the eval set, plan batches."""
    dataset = _open(cfg.path, vocab_size=vocab_size, seed=seed, tokenizer_identity=tokenizer_identity)
    train_set, eval_set = dataset, None
    if cfg.eval_path:
        eval_set = _open(cfg.eval_path, vocab_size=vocab_size, seed=seed, tokenizer_identity=tokenizer_identity)
    elif cfg.eval_fraction > 0:
        order = np.random.default_rng([seed, 7]).permutation(len(dataset))
        k = max(1, int(round(cfg.eval_fraction * len(dataset))))
        if k >= len(dataset):
            raise ConfigError("data.eval_fraction leaves no training samples")
        eval_set, train_set = IndexSubset(dataset, np.sort(order[:k])), IndexSubset(dataset, np.sort(order[k:]))
    try:
        planner = BatchPlanner(train_set.lengths, cfg.plan)
        eval_planner = None
        if eval_set is not None:
            eval_planner = BatchPlanner(eval_set.lengths, dataclasses.replace(cfg.plan, shuffle=False))
    except ValueError as exc:
        raise ConfigError(f"data.plan does not fit {cfg.path}: {exc}") from None
    return DataSplits(train_set, eval_set, planner, eval_planner)
