"""The held-out split of a large dataset in one process and in worker processes (data/splits.py).

Writes a prepared dataset of random conversations (a shared 24-token system prompt, a prompt of
60-300 tokens, an answer of 100-700; two answers a prompt, and one row in 10 repeating another
row's answer with a few tokens changed, so the near-duplicate check has work to do), then
computes its prompt-level split with the recipe's settings once with `--workers 1` and once with
each larger count, and checks that every count gives the same split. Prints the seconds of each.

    PYTHONPATH=src .venv/bin/python bench/split_workers.py --rows 100000 --workers 1 2
    PYTHONPATH=src python bench/split_workers.py --rows 336000 --workers 1 16 --out split.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from dflash_train.data.dataset import TokenDataset
from dflash_train.data.shards import FORMAT_VERSION, MANIFEST, ShardWriter

SYSTEM = np.arange(1, 25, dtype=np.int32)


def write_dataset(path: Path, rows: int, seed: int = 0) -> int:
    """A prepared dataset of `rows` random conversations at `path`; returns its tokens."""
    rng = np.random.default_rng(seed)
    writer, answers, tokens = ShardWriter(path, shard_size=100_000), [], 0
    for k in range(rows):
        if k % 2 == 0:
            prompt = rng.integers(100, 49_000, rng.integers(60, 300), dtype=np.int32)
        answer = rng.integers(100, 49_000, rng.integers(100, 700), dtype=np.int32)
        if k % 10 == 9:  # a near-copy of an earlier answer
            answer = answers[rng.integers(len(answers))].copy()
            answer[rng.integers(len(answer), size=3)] = rng.integers(100, 49_000, 3)
        answers.append(answer)
        ids = np.concatenate([SYSTEM, prompt, answer])
        writer.add(ids, (np.arange(len(ids)) >= len(SYSTEM) + len(prompt)).astype(np.uint8), f"bench:{k + 1}")
        tokens += len(ids)
    manifest = {"format_version": FORMAT_VERSION, "shards": writer.close(), "tokenizer": {}, "rows": rows}
    (path / MANIFEST).write_text(json.dumps(manifest))
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    # imported here, not above: the worker processes import this file as their main module, and
    # these bring torch (a training rank's workers import the light CLI module instead)
    from dflash_train.data.config import DataConfig
    from dflash_train.data.splits import compute_split
    cfg = DataConfig(path="bench", eval_fraction=0.003, dedup_threshold=0.5, dedup_ngram=3)  # the recipe's check
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        tokens = write_dataset(Path(tmp), args.rows)
        print(f"wrote {args.rows:,} rows ({tokens:,} tokens) in {time.perf_counter() - t0:.1f} s", flush=True)
        dataset, results, first = TokenDataset(tmp), [], None
        for workers in args.workers:
            t0 = time.perf_counter()
            split = compute_split(cfg, 0, dataset, workers=workers)
            seconds = time.perf_counter() - t0
            same = first is None or (np.array_equal(split.eval_rows, first.eval_rows)
                                     and np.array_equal(split.train_rows, first.train_rows))
            first = first or split
            results.append({"workers": workers, "seconds": round(seconds, 2), "same_split": same})
            print(f"workers {workers:3d}: {seconds:6.1f} s  same split: {same}  ({split.report.describe()})", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"rows": args.rows, "tokens": tokens, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
