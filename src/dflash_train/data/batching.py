"""Batch planning: length buckets, token-budget packing, per-epoch shuffle, sharding, resume.

For epoch `e` the plan is a deterministic function of (lengths, config, e):

1. Samples are split into length buckets (given boundaries, or quantiles of the lengths
   so every bucket holds about the same number of samples).
2. Within each bucket, samples are shuffled with a generator seeded by (seed, epoch)
   and packed in that order: each goes into the first row of the current batch with
   room for it (rows hold at most `row_tokens` tokens; a batch has at most
   `token_budget // row_tokens` rows); when no row has room, the batch is closed. So
   the padded size R * S of every batch is at most R * row_tokens <= token_budget,
   both in eager mode (S = longest row) and compiled mode (padded to the full shape).
3. The batches of all buckets are shuffled together (same generator).

Sharding across `world` consumers is strided: consumer `rank` gets batches
rank, rank + world, ... When the batch count is not a multiple of `world`, drop_last
drops the last few batches; otherwise the first few are repeated (like PyTorch's
DistributedSampler), so every consumer gets the same number of batches.

A batch's `(epoch, index)` is its place in the consumer's list; every consumer is at the
same index at the same step. Resuming from (epoch, index) re-plans that epoch (cheap,
deterministic) and starts there, so the resumed stream is identical.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from dflash_train.data.batch import PackedBatch, pack_documents

log = logging.getLogger(__name__)


@dataclass
class BatchPlanConfig:
    token_budget: int = 49152
    """max padded tokens per batch (rows x row length)"""
    row_tokens: int | None = None
    """max tokens per packed row (default: token_budget, one row per batch)"""
    bucket_boundaries: list[int] | None = None
    """ascending length boundaries; bucket k holds lengths in [b[k-1], b[k])"""
    num_buckets: int = 6
    """length buckets from quantiles of the lengths (when no boundaries are given)"""
    seed: int = 0
    """shuffling seed"""
    shuffle: bool = True
    """shuffle samples within buckets and batches across buckets, per epoch"""
    drop_last: bool = False
    """when sharding over consumers: drop the tail (true) or repeat the first batches (false)"""

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"token_budget must be positive, got {self.token_budget}")
        if self.row_tokens is None:
            self.row_tokens = self.token_budget
        if not 1 <= self.row_tokens <= self.token_budget:
            raise ValueError(f"row_tokens must be in [1, token_budget={self.token_budget}], got {self.row_tokens}")
        if self.bucket_boundaries is not None:
            b = [int(x) for x in self.bucket_boundaries]
            if any(x < 1 for x in b) or any(y <= x for x, y in zip(b, b[1:])):
                raise ValueError(f"bucket_boundaries must be positive and strictly ascending, got {b}")
            self.bucket_boundaries = b
        if self.num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {self.num_buckets}")

    @property
    def max_rows(self) -> int:
        return self.token_budget // self.row_tokens  # type: ignore[operator]


def _gather_segments(ptr: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR segments `order` of an array with offsets `ptr` -> (element indices, new offsets)."""
    counts = np.diff(ptr)[order]
    new_ptr = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(counts, out=new_ptr[1:])
    idx = np.repeat(ptr[order] - new_ptr[:-1], counts) + np.arange(new_ptr[-1], dtype=np.int64)
    return idx, new_ptr


class EpochPlan:
    """The batches of one epoch, stored flat (CSR): batch b has rows
    row_ptr-range batch_ptr[b]:batch_ptr[b+1]; row r holds samples[row_ptr[r]:row_ptr[r+1]]."""

    def __init__(self, epoch: int, samples: np.ndarray, row_ptr: np.ndarray, batch_ptr: np.ndarray,
                 batch_bucket: np.ndarray):
        self.epoch, self.samples, self.row_ptr = epoch, samples, row_ptr
        self.batch_ptr, self.batch_bucket = batch_ptr, batch_bucket

    def __len__(self) -> int:
        return len(self.batch_ptr) - 1

    def __getitem__(self, b: int) -> list[list[int]]:
        """Rows of batch `b`, each a list of sample indices."""
        if not 0 <= b < len(self):
            raise IndexError(f"batch {b} out of range for a plan of {len(self)}")
        rp = self.row_ptr[self.batch_ptr[b]: self.batch_ptr[b + 1] + 1]
        return [self.samples[a:z].tolist() for a, z in zip(rp[:-1], rp[1:])]

    def __iter__(self) -> Iterator[list[list[int]]]:
        return (self[b] for b in range(len(self)))

    def select(self, batches: np.ndarray) -> "EpochPlan":
        """A plan made of the given batches, in the given order (repeats allowed)."""
        batches = np.asarray(batches, dtype=np.int64)
        rows, batch_ptr = _gather_segments(self.batch_ptr, batches)
        samples, row_ptr = _gather_segments(self.row_ptr, rows)
        return EpochPlan(self.epoch, self.samples[samples], row_ptr, batch_ptr, self.batch_bucket[batches])

    def shard(self, rank: int, world: int, drop_last: bool = False) -> "EpochPlan":
        """Batches rank, rank + world, ... of this plan; every rank gets the same count."""
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} out of range for world size {world}")
        n = len(self)
        per_rank = n // world if drop_last else -(-n // world)
        return self.select((np.arange(per_rank, dtype=np.int64) * world + rank) % max(n, 1))


class _Dataset(Protocol):
    def __len__(self) -> int: ...
    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]: ...


class BatchPlanner:
    """Plans token-budget batches over samples of the given lengths (see module docstring)."""

    def __init__(self, lengths: Sequence[int] | np.ndarray, config: BatchPlanConfig | None = None):
        self.config = config or BatchPlanConfig()
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1 or len(self.lengths) == 0:
            raise ValueError("lengths must be a non-empty 1-D sequence")
        row_tokens = self.config.row_tokens
        too_long = np.flatnonzero(self.lengths > row_tokens)
        if len(too_long):
            i = int(too_long[np.argmax(self.lengths[too_long])])
            raise ValueError(
                f"sample {i} has {self.lengths[i]} tokens but a row holds at most {row_tokens} "
                f"(the token budget is smaller than the longest row; {len(too_long)} samples are too long): "
                "raise token_budget/row_tokens or re-run prepare with a smaller --max-length"
            )
        if (self.lengths < 1).any():
            raise ValueError(f"sample {int(np.argmin(self.lengths))} is empty")
        self.boundaries = self._boundaries()
        self.bucket_of = np.searchsorted(self.boundaries, self.lengths, side="right")
        self._cache: EpochPlan | None = None

    def _boundaries(self) -> np.ndarray:
        cfg = self.config
        if cfg.bucket_boundaries is not None:
            return np.asarray(cfg.bucket_boundaries, dtype=np.int64)
        # Boundaries are sample lengths themselves (bucket k starts at b[k], which occurs),
        # so after removing duplicates and the minimum no derived bucket is empty.
        ranks = (np.arange(1, cfg.num_buckets) * len(self.lengths)) // cfg.num_buckets
        b = np.unique(np.sort(self.lengths)[ranks])
        return b[b > self.lengths.min()]

    @property
    def num_buckets(self) -> int:
        return len(self.boundaries) + 1

    def plan(self, epoch: int) -> EpochPlan:
        """All batches of `epoch`, before sharding. Deterministic in (lengths, config, epoch)."""
        if self._cache is not None and self._cache.epoch == epoch:
            return self._cache
        cfg = self.config
        rng = np.random.default_rng([cfg.seed, epoch])
        n = len(self.lengths)
        order = rng.permutation(n) if cfg.shuffle else np.arange(n)
        order = order[np.argsort(self.bucket_of[order], kind="stable")]  # by bucket, random within

        # Packing is sequential (each choice depends on the rows so far); plain Python over
        # lists is ~1 s per million samples, far from the bottleneck.
        cap, max_rows = int(cfg.row_tokens), cfg.max_rows  # type: ignore[arg-type]
        samples: list[int] = []
        row_sizes: list[int] = []  # samples per row
        batch_rows: list[int] = []  # rows per batch
        batch_bucket: list[int] = []
        rows: list[list[int]] = []
        fill: list[int] = []
        bucket = -1

        def close() -> None:
            for row in rows:
                samples.extend(row)
                row_sizes.append(len(row))
            batch_rows.append(len(rows))
            batch_bucket.append(bucket)

        for s, length, bkt in zip(order.tolist(), self.lengths[order].tolist(), self.bucket_of[order].tolist()):
            if bkt != bucket:
                if rows:
                    close()
                rows, fill, bucket = [], [], bkt
            for r in range(len(fill)):
                if fill[r] + length <= cap:
                    fill[r] += length
                    rows[r].append(s)
                    break
            else:
                if len(rows) == max_rows:
                    close()
                    rows, fill = [], []
                rows.append([s])
                fill.append(length)
        if rows:
            close()

        row_ptr = np.zeros(len(row_sizes) + 1, dtype=np.int64)
        np.cumsum(row_sizes, out=row_ptr[1:])
        batch_ptr = np.zeros(len(batch_rows) + 1, dtype=np.int64)
        np.cumsum(batch_rows, out=batch_ptr[1:])
        plan = EpochPlan(epoch, np.asarray(samples, dtype=np.int64), row_ptr, batch_ptr,
                         np.asarray(batch_bucket, dtype=np.int64))
        if cfg.shuffle:
            plan = plan.select(rng.permutation(len(plan)))
        self._cache = plan
        return plan

    def shard(self, epoch: int, rank: int = 0, world: int = 1) -> EpochPlan:
        return self.plan(epoch).shard(rank, world, self.config.drop_last)

    def batches_per_epoch(self, world: int = 1, epoch: int = 0) -> int:
        """Batches each of `world` consumers gets in `epoch` (the count varies slightly
        between epochs, since packing depends on the shuffle)."""
        n = len(self.plan(epoch))
        return n // world if self.config.drop_last else -(-n // world)

    def iter_batches(
        self,
        dataset: _Dataset,
        start: tuple[int, int] = (0, 0),
        *,
        rank: int = 0,
        world: int = 1,
        epochs: int | None = None,
    ) -> Iterator[PackedBatch]:
        """PackedBatches of consumer `rank`, from cursor `start` = (epoch, index) on, until
        epoch `epochs` (exclusive; None = forever). Each batch carries its (epoch, index);
        to resume after batch (e, i), pass start=(e, i + 1) (an index past the end of an
        epoch simply moves on to the next epoch)."""
        if len(dataset) != len(self.lengths):
            raise ValueError(f"dataset has {len(dataset)} samples, the planner {len(self.lengths)}")
        epoch, index = start
        if epoch < 0 or index < 0:
            raise ValueError(f"bad cursor {start}")
        log.debug("%s", self.describe(epoch, world=world))
        while epochs is None or epoch < epochs:
            plan = self.shard(epoch, rank, world)
            for b in range(index, len(plan)):
                yield build_batch(dataset, plan[b], epoch=epoch, index=b)
            epoch, index = epoch + 1, 0

    def describe(self, epoch: int = 0, world: int = 1) -> str:
        """The per-bucket batch distribution of one epoch, as a printable table."""
        plan = self.plan(epoch)
        cfg = self.config
        k = self.num_buckets
        batches = np.bincount(plan.batch_bucket, minlength=k)
        docs = np.bincount(self.bucket_of, minlength=k)
        tokens = np.bincount(self.bucket_of, weights=self.lengths, minlength=k).astype(np.int64)
        total = max(len(plan), 1)
        rows_desc = "one packed row" if cfg.max_rows == 1 else f"up to {cfg.max_rows} rows of {cfg.row_tokens:,} tokens"
        lines = [
            f"{len(plan):,} batches per epoch across {k} length bucket{'s' if k > 1 else ''} "
            f"(token budget {cfg.token_budget:,}, {rows_desc} per batch"
            + (f", {self.batches_per_epoch(world, epoch):,} per consumer for {world} consumers" if world > 1 else "")
            + ")",
            f"{'bucket':>6}  {'lengths':>15}  {'batches':>10}  {'share':>6}  {'documents':>10}  {'tokens':>14}  {'fill':>6}",
        ]
        for j in range(k):
            in_bucket = self.lengths[self.bucket_of == j]
            span = f"{in_bucket.min():,}-{in_bucket.max():,}" if len(in_bucket) else "-"
            fill = tokens[j] / (batches[j] * cfg.token_budget) if batches[j] else 0.0
            lines.append(
                f"{j:>6}  {span:>15}  {batches[j]:>10,}  {batches[j] / total:>6.1%}  {docs[j]:>10,}  "
                f"{tokens[j]:>14,}  {fill:>6.1%}"
            )
        lines.append(
            f"{'all':>6}  {f'{self.lengths.min():,}-{self.lengths.max():,}':>15}  {len(plan):>10,}  {1:>6.1%}  "
            f"{len(self.lengths):>10,}  {int(self.lengths.sum()):>14,}  "
            f"{self.lengths.sum() / (total * cfg.token_budget):>6.1%}"
        )
        lines.append("lengths: token range of the bucket's documents; fill: tokens / (batches x token budget)")
        return "\n".join(lines)

    def summary(self, epoch: int = 0) -> dict[str, Any]:
        """The same distribution as data (for logs/JSON)."""
        plan = self.plan(epoch)
        k = self.num_buckets
        return {
            "batches": len(plan),
            "boundaries": self.boundaries.tolist(),
            "batches_per_bucket": np.bincount(plan.batch_bucket, minlength=k).tolist(),
            "documents_per_bucket": np.bincount(self.bucket_of, minlength=k).tolist(),
        }


def build_batch(dataset: _Dataset, rows: list[list[int]], *, epoch: int, index: int) -> PackedBatch:
    """The PackedBatch of one planned batch: `rows` lists the sample ids of each row."""
    docs, positions = [], []
    for row in rows:
        positions.append(list(range(len(docs), len(docs) + len(row))))
        docs.extend((s, *dataset[s]) for s in row)
    return pack_documents(docs, positions, epoch=epoch, index=index)
