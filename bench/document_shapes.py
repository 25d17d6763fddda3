"""The shapes the target's document attention meets in a run, and what rounding them costs.

    python bench/document_shapes.py DATASET [--token-budget 65536] [--row-tokens 8192] [--epochs 5]
                                    [--num-buckets 6] [--seed 0] [--out FILE]

Reads only a prepared dataset's lengths and replays the trainer's batch plan (data/batching.py)
for whole epochs. A batch whose rows hold one document each runs causal attention on its packed
rows (one fixed shape once batches are padded for a compiled target); any other batch gathers
its documents into a [D, L] batch (target/documents.py): D documents, L the longest. For those
batches, raw and rounded up (`round_shape`, eight sizes per octave), it reports:

* distinct shapes, and the steps that meet a shape for the first time, per epoch: attention
  kernels that build a plan per shape (cuDNN's) pay for each such step;
* the gathered slots (sum of D * L) and the attention work (sum of D * L^2) against the raw
  shapes, i.e. what rounding costs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from dflash_train.data.batching import BatchPlanConfig, BatchPlanner
from dflash_train.data.dataset import TokenDataset
from dflash_train.target.documents import round_up


def batch_shape(rows: list[list[int]], lengths: np.ndarray) -> tuple[int, int] | None:
    """(D, L) of a batch that gathers its documents; None when every row is one document."""
    if all(len(row) == 1 for row in rows):
        return None
    return sum(len(row) for row in rows), int(max(lengths[s] for row in rows for s in row))


def replay(lengths: np.ndarray, plan_cfg: BatchPlanConfig, epochs: int) -> dict:
    planner = BatchPlanner(lengths, plan_cfg)
    seen: dict[str, set] = {"raw": set(), "rounded": set()}
    new_per_epoch: dict[str, list[int]] = {"raw": [], "rounded": []}
    slots = {"raw": 0, "rounded": 0}
    work = {"raw": 0, "rounded": 0}
    steps = gathered = 0
    for epoch in range(epochs):
        new = {"raw": 0, "rounded": 0}
        for rows in planner.plan(epoch):
            steps += 1
            shape = batch_shape(rows, lengths)
            if shape is None:
                continue
            gathered += 1
            D, L = shape
            for kind, (d, l) in (("raw", (D, L)), ("rounded", (round_up(D), round_up(L)))):
                if (d, l) not in seen[kind]:
                    seen[kind].add((d, l))
                    new[kind] += 1
                slots[kind] += d * l
                work[kind] += d * l * l
        for kind, count in new.items():
            new_per_epoch[kind].append(count)
    return {
        "steps": steps, "gathering_steps": gathered,
        "distinct_shapes": {k: len(v) for k, v in seen.items()},
        "new_shapes_per_epoch": new_per_epoch,
        "rounding_extra_slots": slots["rounded"] / max(slots["raw"], 1) - 1,
        "rounding_extra_attention_work": work["rounded"] / max(work["raw"], 1) - 1,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dataset", help="a prepared dataset folder (dflash-train prepare)")
    p.add_argument("--token-budget", type=int, default=65536)
    p.add_argument("--row-tokens", type=int, default=8192)
    p.add_argument("--num-buckets", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args(argv)
    lengths = TokenDataset(args.dataset).lengths
    cfg = BatchPlanConfig(token_budget=args.token_budget, row_tokens=args.row_tokens,
                          num_buckets=args.num_buckets, seed=args.seed)
    result = {"dataset": str(args.dataset), "samples": int(len(lengths)), "tokens": int(lengths.sum(dtype=np.int64)),
              "token_budget": args.token_budget, "row_tokens": args.row_tokens, "epochs": args.epochs,
              **replay(lengths, cfg, args.epochs)}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
