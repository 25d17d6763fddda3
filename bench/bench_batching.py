"""Benchmark the batch planner on 1M samples.

    python bench/bench_batching.py                    # 1M samples, default config
    python bench/bench_batching.py --samples 200000 --row-tokens 8192 --out /tmp/b.json

Lengths come from a log-normal mixture shaped like chat SFT data (short one-turn answers
plus a long tail of multi-turn and reasoning conversations, capped at 8,192 tokens).
Reports planner construction (bucketing), planning one epoch, planning the next one,
sharding, the distribution table the trainer prints, and how fast PackedBatches are
assembled from in-memory token arrays.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from dflash_train.data.batching import BatchPlanConfig, BatchPlanner
from dflash_train.data.batch import pack_documents


def realistic_lengths(n: int, seed: int = 0, max_length: int = 8192) -> np.ndarray:
    rng = np.random.default_rng(seed)
    short = rng.lognormal(np.log(450), 0.7, n)  # single-turn chat
    long = rng.lognormal(np.log(2600), 0.6, n)  # multi-turn / reasoning
    lengths = np.where(rng.random(n) < 0.55, short, long)
    return np.clip(lengths, 32, max_length).astype(np.int64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--token-budget", type=int, default=49152)
    parser.add_argument("--row-tokens", type=int, default=None)
    parser.add_argument("--world", type=int, default=8, help="consumers to shard over")
    parser.add_argument("--out", default=str(Path(__file__).with_suffix(".json")))
    args = parser.parse_args()

    lengths = realistic_lengths(args.samples)
    cfg = BatchPlanConfig(token_budget=args.token_budget, row_tokens=args.row_tokens, seed=0)
    t = time.perf_counter()
    planner = BatchPlanner(lengths, cfg)
    init_s = time.perf_counter() - t
    t = time.perf_counter()
    planner.plan(0)
    plan0_s = time.perf_counter() - t
    t = time.perf_counter()
    plan1 = planner.plan(1)
    plan1_s = time.perf_counter() - t
    t = time.perf_counter()
    shards = [plan1.shard(r, args.world) for r in range(args.world)]
    shard_s = time.perf_counter() - t
    table = planner.describe(1, world=args.world)
    print(table)

    # Assemble PackedBatches from in-memory documents (the dataset read is benchmarked elsewhere).
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 49152, int(lengths.max()), dtype=np.int32)
    mask = rng.random(int(lengths.max())) < 0.7
    t, built, real = time.perf_counter(), 0, 0
    for b in range(200):
        rows = shards[0][b]
        docs, positions = [], []
        for row in rows:
            positions.append(list(range(len(docs), len(docs) + len(row))))
            docs += [(s, tokens[: lengths[s]], mask[: lengths[s]]) for s in row]
        batch = pack_documents(docs, positions)
        built += 1
        real += batch.num_tokens
    pack_s = time.perf_counter() - t

    result = {
        "samples": args.samples,
        "tokens": int(lengths.sum()),
        "config": {"token_budget": cfg.token_budget, "row_tokens": cfg.row_tokens, "num_buckets": cfg.num_buckets},
        "batches_per_epoch": len(plan1),
        "batches_per_consumer": len(shards[0]),
        "consumers": args.world,
        "bucket_boundaries": planner.boundaries.tolist(),
        "init_s": round(init_s, 3),
        "plan_epoch0_s": round(plan0_s, 3),
        "plan_epoch1_s": round(plan1_s, 3),
        "shard_all_s": round(shard_s, 3),
        "pack_batches_per_s": round(built / pack_s, 1),
        "pack_tokens_per_s": round(real / pack_s),
        "table": table.splitlines(),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "table"}, indent=2))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
