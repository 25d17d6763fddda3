"""BatchPlanner: budget, coverage, determinism, sharding, resume, layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_train.data.batching import BatchPlanConfig, BatchPlanner
from dflash_train.utils.config import ConfigError, from_dict

from .test_data_batch import brute_force


class ListDataset:
    """In-memory stand-in for TokenDataset: sample i has tokens i*1000 + k."""

    def __init__(self, lengths):
        self.lengths = np.asarray(lengths)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = int(self.lengths[i])
        return np.arange(n, dtype=np.int32) + i * 1000, (np.arange(n) % 3) > 0


def random_case(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    row_tokens = int(rng.integers(8, 300))
    max_rows = int(rng.integers(1, 5))
    budget = row_tokens * max_rows + int(rng.integers(0, row_tokens))  # budget need not be a multiple
    kind = seed % 3
    if kind == 0:
        lengths = rng.integers(1, row_tokens + 1, n)
    elif kind == 1:
        lengths = np.clip(rng.lognormal(np.log(row_tokens / 5), 1.0, n).astype(int), 1, row_tokens)
    else:
        lengths = rng.choice([1, row_tokens, max(1, row_tokens // 2)], n)
    if seed % 2:
        bounds = sorted(set(rng.integers(2, row_tokens + 2, int(rng.integers(1, 5))).tolist()))
        cfg = BatchPlanConfig(token_budget=budget, row_tokens=row_tokens, bucket_boundaries=bounds, seed=seed)
    else:
        cfg = BatchPlanConfig(token_budget=budget, row_tokens=row_tokens, num_buckets=int(rng.integers(1, 8)), seed=seed)
    return lengths, cfg


@pytest.mark.parametrize("seed", range(40))
def test_budget_coverage_buckets(seed):
    lengths, cfg = random_case(seed)
    planner = BatchPlanner(lengths, cfg)
    for epoch in (0, 1):
        plan = planner.plan(epoch)
        seen = []
        for b, rows in enumerate(plan):
            row_sums = [int(lengths[row].sum()) for row in rows]
            assert all(rows) and len(rows) <= cfg.max_rows
            assert max(row_sums) <= cfg.row_tokens
            assert len(rows) * max(row_sums) <= cfg.token_budget  # eager: R * S
            assert cfg.max_rows * cfg.row_tokens <= cfg.token_budget  # compiled: fixed shape
            buckets = {int(planner.bucket_of[s]) for row in rows for s in row}
            assert buckets == {int(plan.batch_bucket[b])}  # one bucket per batch
            seen += [s for row in rows for s in row]
        assert sorted(seen) == list(range(len(lengths)))  # every sample exactly once


def test_buckets_follow_boundaries():
    lengths = np.array([1, 5, 9, 10, 11, 99, 100, 500])
    planner = BatchPlanner(lengths, BatchPlanConfig(token_budget=1000, bucket_boundaries=[10, 100]))
    assert planner.bucket_of.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]


def test_quantile_buckets_are_balanced_and_nonempty():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 5000, 60_000)
    planner = BatchPlanner(lengths, BatchPlanConfig(num_buckets=6))
    counts = np.bincount(planner.bucket_of)
    assert len(counts) == 6 and counts.min() > 0.95 * len(lengths) / 6
    # Degenerate: all equal lengths -> one bucket, no empty ones.
    assert BatchPlanner(np.full(10, 7), BatchPlanConfig()).num_buckets == 1


def test_determinism():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 500, 3000)
    cfg = BatchPlanConfig(token_budget=2048, row_tokens=512, seed=5)
    a, b = BatchPlanner(lengths, cfg), BatchPlanner(lengths, BatchPlanConfig(token_budget=2048, row_tokens=512, seed=5))
    assert list(a.plan(3)) == list(b.plan(3))
    assert list(a.plan(0)) != list(a.plan(1))  # different per epoch: order and membership
    assert {tuple(map(tuple, x)) for x in a.plan(0)} != {tuple(map(tuple, x)) for x in a.plan(1)}
    other = BatchPlanner(lengths, BatchPlanConfig(token_budget=2048, row_tokens=512, seed=6))
    assert list(other.plan(0)) != list(a.plan(0))
    fixed = BatchPlanner(lengths, BatchPlanConfig(token_budget=2048, row_tokens=512, shuffle=False))
    assert list(fixed.plan(0)) == list(fixed.plan(1))


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sharding(world, drop_last):
    rng = np.random.default_rng(world)
    lengths = rng.integers(1, 300, 500)
    planner = BatchPlanner(lengths, BatchPlanConfig(token_budget=1200, row_tokens=300, drop_last=drop_last))
    full = [tuple(map(tuple, b)) for b in planner.plan(0)]
    shards = [[tuple(map(tuple, b)) for b in planner.shard(0, r, world)] for r in range(world)]
    sizes = {len(s) for s in shards}
    assert sizes == {planner.batches_per_epoch(world)}  # balanced
    n = len(full)
    if drop_last:
        assert len(shards[0]) == n // world
        union = [b for s in shards for b in s]
        assert len(set(union)) == len(union)  # disjoint
        assert set(union) == set(full[: n // world * world])
    else:
        assert len(shards[0]) == -(-n // world)
        for r in range(world):  # strided: batch r, r + world, ... wrapping around at the end
            assert shards[r] == [full[(i * world + r) % n] for i in range(len(shards[r]))]
        union = [b for s in shards for b in s]
        assert set(union) == set(full)  # every sample covered; only the wrapped tail repeats
        assert len(union) - n == (-n) % world


def test_iter_batches_layout_and_resume():
    rng = np.random.default_rng(2)
    lengths = rng.integers(1, 64, 300)
    ds = ListDataset(lengths)
    planner = BatchPlanner(lengths, BatchPlanConfig(token_budget=256, row_tokens=64, seed=3))
    stream = list(planner.iter_batches(ds, epochs=2))
    per_epoch = len(planner.plan(0)), len(planner.plan(1))
    assert len(stream) == sum(per_epoch)
    assert [(b.epoch, b.index) for b in stream] == [(e, i) for e in range(2) for i in range(per_epoch[e])]
    for b in stream:
        rows = planner.plan(b.epoch)[b.index]
        docs = [(s, *ds[s]) for row in rows for s in row]
        positions, k = [], 0
        for row in rows:
            positions.append(list(range(k, k + len(row))))
            k += len(row)
        ids, pos, doc, loss, sids = brute_force(docs, positions)
        assert b.input_ids.tolist() == ids and b.position_ids.tolist() == pos
        assert b.document_ids.tolist() == doc and b.loss_mask.tolist() == loss and b.sample_ids.tolist() == sids
        assert b.shape[0] * b.shape[1] <= 256

    for cut in (0, 1, per_epoch[0] - 1, per_epoch[0], per_epoch[0] + 5):
        last = stream[cut]
        resumed = list(planner.iter_batches(ds, start=(last.epoch, last.index + 1), epochs=2))
        # A fresh planner (a restarted job) must give the same stream.
        fresh = BatchPlanner(lengths, BatchPlanConfig(token_budget=256, row_tokens=64, seed=3))
        resumed_fresh = list(fresh.iter_batches(ds, start=(last.epoch, last.index + 1), epochs=2))
        for got in (resumed, resumed_fresh):
            assert len(got) == len(stream) - cut - 1
            for x, y in zip(got, stream[cut + 1:]):
                assert (x.epoch, x.index) == (y.epoch, y.index)
                assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.sample_ids, y.sample_ids)


def test_iter_batches_sharded_covers_epoch():
    lengths = np.random.default_rng(4).integers(1, 100, 400)
    ds = ListDataset(lengths)
    planner = BatchPlanner(lengths, BatchPlanConfig(token_budget=400, row_tokens=100, drop_last=True))
    seen = []
    for rank in range(3):
        seen += [int(s) for b in planner.iter_batches(ds, rank=rank, world=3, epochs=1) for s in b.sample_ids]
    assert len(seen) == len(set(seen))


def test_errors():
    with pytest.raises(ValueError, match=r"sample 2 has 70 tokens but a row holds at most 64.*budget is smaller than the longest row"):
        BatchPlanner([5, 10, 70, 65], BatchPlanConfig(token_budget=128, row_tokens=64))
    with pytest.raises(ValueError, match="row_tokens"):
        BatchPlanConfig(token_budget=100, row_tokens=200)
    with pytest.raises(ValueError, match="ascending"):
        BatchPlanConfig(bucket_boundaries=[10, 5])
    with pytest.raises(ConfigError, match="token_budget"):
        from_dict(BatchPlanConfig, {"token_budget": 0})
    planner = BatchPlanner([1, 2, 3], BatchPlanConfig(token_budget=10))
    with pytest.raises(ValueError, match="dataset has 2 samples"):
        next(planner.iter_batches(ListDataset([1, 2])))
    assert BatchPlanConfig(token_budget=100).row_tokens == 100


def test_describe_table():
    rng = np.random.default_rng(5)
    lengths = np.concatenate([rng.integers(10, 100, 1000), rng.integers(1000, 4000, 1000)])
    planner = BatchPlanner(lengths, BatchPlanConfig(token_budget=8192, bucket_boundaries=[500]))
    text = planner.describe()
    plan = planner.plan(0)
    counts = np.bincount(plan.batch_bucket, minlength=2)
    assert text.startswith(f"{len(plan):,} batches per epoch across 2 length buckets")
    lines = text.splitlines()
    row0 = lines[2].split()
    row1 = lines[3].split()
    assert row0[0] == "0" and row0[1] == f"{lengths[lengths < 500].min()}-{lengths[lengths < 500].max()}"
    assert int(row0[2].replace(",", "")) == counts[0] and int(row1[2].replace(",", "")) == counts[1]
    assert row0[3] == f"{counts[0] / len(plan):.1%}"
    assert int(row0[4].replace(",", "")) == 1000 and int(row1[5].replace(",", "")) == lengths[lengths >= 500].sum()
