"""Synthetic training documents for benchmarks: `data.path: synthetic:N:LEN` (or `LO-HI`).

N documents of random tokens, each of LEN tokens (or uniformly LO..HI), with a chat-like
loss mask: the first quarter is the "prompt", the rest the "answer". Documents are
generated on access from (seed, index), so a million of them cost nothing to hold.
"""

from __future__ import annotations

import numpy as np

from dflash_train.utils.errors import ConfigError

PREFIX = "synthetic:"


def is_synthetic(path: str) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


class SyntheticDataset:
    def __init__(self, spec: str, *, vocab_size: int, seed: int = 0):
        try:
            _, n, length = spec.split(":")
            lo, _, hi = length.partition("-")
            n, lo, hi = int(n), int(lo), int(hi or lo)
        except ValueError:
            raise ConfigError(f"bad synthetic data spec {spec!r}: use synthetic:N:LEN or synthetic:N:LO-HI") from None
        if n < 1 or not 2 <= lo <= hi:
            raise ConfigError(f"bad synthetic data spec {spec!r}: need N >= 1 and 2 <= LO <= HI")
        self.vocab_size, self.seed = vocab_size, seed
        self.lengths = np.random.default_rng([seed, 1]).integers(lo, hi + 1, size=n).astype(np.int64)
        self.manifest = {"synthetic": spec}

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        length = int(self.lengths[i])
        rng = np.random.default_rng([self.seed, 2, i])
        ids = rng.integers(0, self.vocab_size, size=length, dtype=np.int64)
        mask = np.zeros(length, dtype=bool)
        mask[length // 4:] = True
        return ids, mask
