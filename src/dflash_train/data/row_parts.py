"""The held-out split's view of a dataset's rows: prompt and answer ids, prompt hashes.

Its imports are light (numpy, hashlib; a dataset it reads brings pyarrow), so the worker processes
that read a large dataset's rows for the split (data/splits.py) start in a fraction of a second.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dflash_train.utils.parallel import ordered_map


def prompt_and_answer(sample) -> tuple[np.ndarray, np.ndarray]:
    """(prompt ids [P], answer ids [A]) of an (input_ids, loss_mask) sample: the tokens before the
    first loss-masked token (what the model answers), and the loss-masked tokens."""
    ids, mask = sample
    ids, mask = np.asarray(ids), np.asarray(mask, dtype=bool)
    first = int(np.argmax(mask)) if mask.any() else len(ids)
    return ids[:first], ids[mask]


def prompt_hashes(dataset, rows: np.ndarray, workers: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(uint64 [R] prompt hash, bool [R] has a prompt) of `rows`. A row with no prompt (a `text`
    row: loss on every token) is its own group: hashed on all its tokens. With `workers` > 1,
    in that many slices of `rows` by fresh worker processes (`dataset` must pickle cheaply)."""
    if workers > 1 and len(rows) >= 2 * workers:
        tasks = [(dataset, part) for part in np.array_split(rows, workers)]
        parts = ordered_map(_prompt_hashes_of_slice, tasks, workers, per_worker=1, fresh_processes=True)
        return np.concatenate([h for h, _ in parts]), np.concatenate([p for _, p in parts])
    hashes, has_prompt = np.zeros(len(rows), np.uint64), np.zeros(len(rows), bool)
    for k, i in enumerate(rows.tolist()):
        sample = dataset[i]
        prompt, _ = prompt_and_answer(sample)
        has_prompt[k] = len(prompt) > 0
        data = b"p" + prompt.astype(np.int32).tobytes() if len(prompt) else b"r" + np.asarray(
            sample[0]).astype(np.int32).tobytes()
        hashes[k] = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return hashes, has_prompt


def _prompt_hashes_of_slice(task: tuple) -> tuple[np.ndarray, np.ndarray]:
    dataset, rows = task
    return prompt_hashes(dataset, rows)


class RowParts:
    """Lazy sequence: the prompt (part 0) or answer (part 1) ids of `rows` of `dataset`."""

    def __init__(self, dataset, rows: np.ndarray, part: int):
        self.dataset, self.rows, self.part = dataset, rows, part

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int | slice):  # an item's ids, or a slice as another view
        if isinstance(i, slice):
            return RowParts(self.dataset, self.rows[i], self.part)
        return prompt_and_answer(self.dataset[int(self.rows[i])])[self.part]
