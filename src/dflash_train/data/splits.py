"""The datasets a run reads: open and check them, split off the evaluation set, plan batches.

Nothing here loads a model: every problem with the data is found before the target loads.

The held-out split (`data.eval_split: prompt`, docs/data.md "Held-out split"): rows are
grouped by prompt (the tokens before the first loss-masked one); a group goes to eval when
its seeded prompt hash falls under `eval_fraction`, so the same prompt is never on both
sides. Eval rows whose prompt or answer near-duplicates a training row's (`dedup.py`) are
then dropped from eval. The result is cached in `<dataset>/.splits/<key>.npz`, keyed by the
manifests and the settings, so starts and resumes after the first do not recompute it. A dataset
of `PARALLEL_MIN_ROWS` rows or more is hashed and compared in slices by this rank's share of the
cores (fresh worker processes, `utils/parallel.py`: the same split, a fraction of the wait).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_train.data.batching import BatchPlanner
from dflash_train.data.config import DataConfig
from dflash_train.data.dataset import TokenDataset
from dflash_train.data.dedup import common_shingles, mix64, near_duplicate_of
from dflash_train.data.row_parts import RowParts, prompt_and_answer, prompt_hashes
from dflash_train.data.synthetic import SyntheticDataset, is_synthetic
from dflash_train.utils.errors import ConfigError, DataError
from dflash_train.utils.parallel import cores_of_this_process

log = logging.getLogger(__name__)

SPLIT_VERSION = 1  # part of the cache key: bump when the rule changes so old files are not reused
CACHE_DIR = ".splits"
# n-grams in more than 5% of (and at least 10) training prompts or answers are boilerplate (chat
# template, system prompt, stock phrases): left out of the Jaccard, or every prompt that shares a
# system prompt would look like a near-duplicate of every other
BOILERPLATE_FRACTION, BOILERPLATE_MIN_COUNT = 0.05, 10
# below this many rows the split runs in this process: starting the workers (a fork server and
# their imports, ~1 s) costs more than their slices save (~10K rows a second a core)
PARALLEL_MIN_ROWS = 100_000


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
class SplitReport:
    rule: str  # "prompt", "row" (random rows) or "eval_path" (a separate eval dataset)
    train_rows: int
    eval_rows: int  # drawn for eval, before near-duplicates are dropped
    eval_rows_kept: int
    eval_groups: int | None = None  # distinct prompts among the drawn eval rows (not counted for "row")
    dropped_prompt_duplicates: int = 0  # eval rows whose prompt is (near-)identical to a training prompt
    dropped_answer_duplicates: int = 0  # of the others, those whose answer near-duplicates a training answer
    dedup_threshold: float = 0.0  # 0: no near-duplicate check
    dedup_ngram: int = 0
    duplicates_kept: bool = False  # every eval row was a duplicate: all were kept, eval is not held out
    seconds: float = 0.0  # to compute the split (a cache hit reports the original time)
    workers: int = 1  # processes that computed it
    cache: str = ""  # "hit", "written", "not written (why)", "" when not cached

    def describe(self) -> str:
        drawn = f"{self.eval_rows:,} eval rows" + (f" of {self.eval_groups:,} prompt(s)" if self.eval_groups else "")
        text = f"eval split ({self.rule}): {drawn}"
        if self.rule != "row":
            check = f"Jaccard >= {self.dedup_threshold} over {self.dedup_ngram}-grams" if self.dedup_threshold else "exact"
            text += (f", dropped {self.dropped_prompt_duplicates:,} by prompt and {self.dropped_answer_duplicates:,}"
                     f" by answer as duplicates of training rows ({check})")
        text += f"; {self.eval_rows_kept:,} eval rows kept, {self.train_rows:,} training rows; {self.seconds:.1f} s"
        text += f" in {self.workers} processes" if self.workers > 1 else ""
        text += f" (cache: {self.cache})" if self.cache else ""
        if self.duplicates_kept:
            fix = "data.eval_path repeats data.path" if self.rule == "eval_path" else \
                "raise data.dedup_threshold, or give a data.eval_path"
            text += (f"; WARNING: every eval row duplicates training data, so all were kept and eval metrics are not"
                     f" held-out estimates ({fix})")
        return text


@dataclass
class DataSplits:
    train: Any  # TokenDataset, SyntheticDataset or IndexSubset of one
    eval: Any | None
    planner: BatchPlanner  # of `train`
    eval_planner: BatchPlanner | None  # of `eval`, never shuffled
    report: SplitReport | None = None  # how `eval` was held out (None: no eval set)
    seed: int = 0  # orders eval_prompts()
    _prompt_rows: np.ndarray | None = field(default=None, repr=False)  # int64 [P]: positions in `eval`

    def eval_prompts(self, limit: int | None = None) -> list[np.ndarray]:
        """Token ids (int [L] each) of up to `limit` distinct non-empty prompts of the eval set, in a
        fixed pseudo-random order (by seeded prompt hash), so any prefix is a sample of the split."""
        if self.eval is None:
            return []
        if self._prompt_rows is None:
            hashes, has_prompt = prompt_hashes(self.eval, np.arange(len(self.eval)))
            _, first = np.unique(hashes, return_index=True)
            first = first[has_prompt[first]]
            self._prompt_rows = first[np.argsort(_seeded(hashes[first], self.seed), kind="stable")]
        return [prompt_and_answer(self.eval[int(i)])[0].copy() for i in self._prompt_rows[:limit]]


def _seeded(hashes: np.ndarray, seed: int) -> np.ndarray:
    """uint64: a uniform pseudo-random value per hash, fixed by (seed, hash)."""
    return mix64(hashes ^ mix64(np.array([seed % 2**64], np.uint64))[0])


def in_eval(hashes: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """bool: does the prompt group of each hash go to eval? A function of (seed, hash) alone, so
    rows added to a dataset never move an existing prompt to the other side."""
    return _seeded(hashes, seed) < np.uint64(int(fraction * 2.0**64))


@dataclass
class HeldOut:
    train_rows: np.ndarray | None  # int64 sorted; None: the whole dataset (with eval_path)
    eval_rows: np.ndarray  # int64 sorted, into the eval dataset
    report: SplitReport


def _drop_duplicates(cfg: DataConfig, seed: int, eval_ds, eval_rows: np.ndarray, eval_hashes: np.ndarray,
                     train_ds, train_rows: np.ndarray, train_hashes: np.ndarray, workers: int = 1
                     ) -> tuple[np.ndarray, int, int]:
    """(kept eval rows, dropped by prompt, dropped by answer): an eval row goes when its prompt
    equals or near-duplicates a training prompt, or else its answer near-duplicates a training answer."""
    by_prompt = np.isin(eval_hashes, train_hashes)  # exact: only possible with a separate eval dataset
    by_answer = np.zeros(len(eval_rows), bool)
    if cfg.dedup_threshold > 0:
        dedup = {"threshold": cfg.dedup_threshold, "ngram": cfg.dedup_ngram, "seed": seed, "workers": workers}
        common = {"min_fraction": BOILERPLATE_FRACTION, "min_count": BOILERPLATE_MIN_COUNT, "seed": seed}
        # prompts: one per distinct prompt on each side
        _, eval_first, eval_group = np.unique(eval_hashes, return_index=True, return_inverse=True)
        _, train_first = np.unique(train_hashes, return_index=True)
        train_prompts = RowParts(train_ds, train_rows[np.sort(train_first)], 0)
        queries = RowParts(eval_ds, eval_rows[eval_first], 0)
        near = near_duplicate_of([queries[g] for g in range(len(queries))], train_prompts,
                                 ignore=common_shingles(train_prompts, cfg.dedup_ngram, **common), **dedup)
        by_prompt |= near[eval_group.ravel()]
        # answers: of every training row, for the eval rows still in
        rest = np.flatnonzero(~by_prompt)
        train_answers = RowParts(train_ds, train_rows, 1)
        queries = RowParts(eval_ds, eval_rows[rest], 1)
        by_answer[rest] = near_duplicate_of([queries[k] for k in range(len(queries))], train_answers,
                                            ignore=common_shingles(train_answers, cfg.dedup_ngram, **common), **dedup)
    keep = ~(by_prompt | by_answer)
    return eval_rows[keep], int(by_prompt.sum()), int(by_answer.sum())


def compute_split(cfg: DataConfig, seed: int, dataset, eval_dataset=None, workers: int = 1) -> HeldOut:
    """The prompt-level split of `dataset` (or, with `eval_dataset`, which of its rows to keep);
    `workers` > 1 reads the training rows in that many worker processes (the same result)."""
    t0 = time.perf_counter()
    all_rows = np.arange(len(dataset), dtype=np.int64)
    hashes, _ = prompt_hashes(dataset, all_rows, workers)
    if eval_dataset is not None:
        train_rows, eval_rows = all_rows, np.arange(len(eval_dataset), dtype=np.int64)
        train_hashes, (eval_hashes, _) = hashes, prompt_hashes(eval_dataset, eval_rows)
        rule, eval_ds = "eval_path", eval_dataset
    else:
        groups, group_of = np.unique(hashes, return_inverse=True)
        eval_group = in_eval(groups, seed, cfg.eval_fraction)
        if not eval_group.any():
            eval_group[np.argmin(_seeded(groups, seed))] = True  # a tiny dataset still gets one eval prompt
        if eval_group.all():
            raise ConfigError(f"data.eval_fraction leaves no training samples ({len(groups)} distinct prompts)")
        row_in_eval = eval_group[group_of.ravel()]
        train_rows, eval_rows = all_rows[~row_in_eval], all_rows[row_in_eval]
        train_hashes, eval_hashes = hashes[~row_in_eval], hashes[row_in_eval]
        rule, eval_ds = "prompt", dataset
    kept, by_prompt, by_answer = _drop_duplicates(cfg, seed, eval_ds, eval_rows, eval_hashes,
                                                  dataset, train_rows, train_hashes, workers)
    report = SplitReport(rule, len(train_rows), len(eval_rows), len(kept), eval_groups=len(np.unique(eval_hashes)),
                         dropped_prompt_duplicates=by_prompt, dropped_answer_duplicates=by_answer,
                         dedup_threshold=cfg.dedup_threshold, dedup_ngram=cfg.dedup_ngram,
                         seconds=round(time.perf_counter() - t0, 3), workers=workers)
    if not len(kept):  # a tiny or templated dataset: an eval set that is not held out beats none
        kept, report.eval_rows_kept, report.duplicates_kept = eval_rows, len(eval_rows), True
    return HeldOut(None if eval_dataset is not None else train_rows, kept, report)


def _cache_path(cfg: DataConfig, seed: int, dataset: TokenDataset, eval_dataset: TokenDataset | None) -> Path:
    settings = {"version": SPLIT_VERSION, "manifest": dataset.manifest, "seed": seed, "eval_split": cfg.eval_split,
                "eval_manifest": eval_dataset.manifest if eval_dataset is not None else None,
                "eval_fraction": cfg.eval_fraction, "threshold": cfg.dedup_threshold, "ngram": cfg.dedup_ngram}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return dataset.path / CACHE_DIR / f"{key}.npz"


def held_out_split(cfg: DataConfig, seed: int, dataset: TokenDataset, eval_dataset: TokenDataset | None = None,
                   workers: int | None = None) -> HeldOut:
    """`compute_split`, read from its cache file when there is one, else computed and written there
    (`workers`: None = this rank's share of the cores for a dataset of `PARALLEL_MIN_ROWS` or more)."""
    path = _cache_path(cfg, seed, dataset, eval_dataset)
    try:
        with np.load(path, allow_pickle=False) as saved:
            report = SplitReport(**json.loads(str(saved["report"])))
            train_rows = saved.get("train_rows")  # absent with eval_path: all rows train
            split = HeldOut(train_rows, saved["eval_rows"], dataclasses.replace(report, cache="hit"))
        return split
    except FileNotFoundError:
        pass
    except (OSError, EOFError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as exc:  # damaged: redo
        log.warning("ignoring the unreadable split cache %s (%s)", path, exc)
    if workers is None:
        workers = cores_of_this_process() if len(dataset) >= PARALLEL_MIN_ROWS else 1
    split = compute_split(cfg, seed, dataset, eval_dataset, workers)
    arrays = {"eval_rows": split.eval_rows, "report": np.array(json.dumps(dataclasses.asdict(split.report)))}
    if split.train_rows is not None:
        arrays["train_rows"] = split.train_rows
    tmp = None
    try:
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=path.stem, suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as out:
            np.savez(out, **arrays)
        os.replace(tmp, path)  # atomic: concurrent ranks each write a whole file, the last one wins
        split.report.cache = "written"
    except OSError as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        split.report.cache = f"not written ({exc.strerror or exc})"
        log.info("could not write the split cache %s (%s): the split was computed in memory", path, exc)
    return split


def _random_rows(n: int, fraction: float, seed: int) -> HeldOut:
    """`eval_split: row` (and synthetic data): a random `fraction` of rows, deterministic by seed."""
    order = np.random.default_rng([seed, 7]).permutation(n)
    k = max(1, round(fraction * n))
    if k >= n:
        raise ConfigError("data.eval_fraction leaves no training samples")
    report = SplitReport("row", n - k, k, k)
    return HeldOut(np.sort(order[k:]), np.sort(order[:k]), report)


def _open(path: str, *, vocab_size: int, seed: int, tokenizer_identity: dict | None):
    dataset = SyntheticDataset(path, vocab_size=vocab_size, seed=seed) if is_synthetic(path) else TokenDataset(path)
    if len(dataset) == 0:
        raise DataError(path, None, None, "the dataset is empty (0 samples): check the prepare manifest")
    if tokenizer_identity is not None and not is_synthetic(path):
        dataset.check_tokenizer(tokenizer_identity)
    return dataset


def open_data(cfg: DataConfig, *, seed: int, vocab_size: int, tokenizer_identity: dict | None) -> DataSplits:
    """Open and check the datasets (against the target's tokenizer fingerprint when given),
    split off the eval set (synthetic data: random rows, no duplicate check), plan batches."""
    dataset = _open(cfg.path, vocab_size=vocab_size, seed=seed, tokenizer_identity=tokenizer_identity)
    train_set, eval_set, split = dataset, None, None
    synthetic = is_synthetic(cfg.path) or is_synthetic(cfg.eval_path)
    if cfg.eval_path:
        eval_set = _open(cfg.eval_path, vocab_size=vocab_size, seed=seed, tokenizer_identity=tokenizer_identity)
        if not synthetic:
            split = held_out_split(cfg, seed, dataset, eval_set)
            eval_set = IndexSubset(eval_set, split.eval_rows)
    elif cfg.eval_fraction > 0:
        t0 = time.perf_counter()
        if synthetic or cfg.eval_split == "row":
            split = _random_rows(len(dataset), cfg.eval_fraction, seed)
            split.report.seconds = round(time.perf_counter() - t0, 3)
        else:
            split = held_out_split(cfg, seed, dataset)
        train_set, eval_set = IndexSubset(dataset, split.train_rows), IndexSubset(dataset, split.eval_rows)
    if split is not None:
        log.log(logging.WARNING if split.report.duplicates_kept else logging.INFO, "%s", split.report.describe())
    try:
        planner = BatchPlanner(train_set.lengths, cfg.plan)
        eval_planner = None
        if eval_set is not None:
            eval_planner = BatchPlanner(eval_set.lengths, dataclasses.replace(cfg.plan, shuffle=False))
    except ValueError as exc:
        raise ConfigError(f"data.plan does not fit {cfg.path}: {exc}") from None
    return DataSplits(train_set, eval_set, planner, eval_planner, split.report if split else None, seed)
