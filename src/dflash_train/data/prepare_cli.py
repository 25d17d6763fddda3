"""Tokenize conversations into Arrow shards with assistant loss masks.

    dflash-train prepare --target builtin data/chats.jsonl --output runs/data --max-length 8192
"""

from __future__ import annotations

import argparse

from dflash_train.data.batching import BatchPlanConfig, BatchPlanner
from dflash_train.data.dataset import TokenDataset
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.utils.errors import DataError

CONFIG = PrepareConfig
TRAIN_BUDGET = BatchPlanConfig().token_budget  # train's default data.plan.token_budget


def run(cfg: PrepareConfig, args: argparse.Namespace | None = None) -> int:
    try:
        manifest = prepare(cfg)
    except DataError as exc:
        if exc.line is None or cfg.skip_bad_rows:  # a whole file is unusable: skipping rows cannot help
            raise
        raise DataError(exc.file, exc.line, exc.field, f"{exc.problem}  (pass --skip-bad-rows to skip such rows)") from None
    c, t = manifest["counts"], manifest["tokens"]
    print(f"wrote {c['rows_kept']:,} rows ({t['total']:,} tokens, {t['loss']:,} loss tokens) "
          f"in {len(manifest['shards'])} shard(s) to {cfg.output} in {manifest['seconds']:.1f} s")
    print(f"read {c['rows_read']:,} rows: {c['truncated']:,} truncated, {c['dropped_too_long']:,} dropped as too long, "
          f"{c['dropped_no_loss']:,} dropped with no loss tokens, {c['bad_rows']:,} bad")
    if c.get("split_rows"):
        print(f"{c['split_rows']:,} rows come from multi-turn conversations split into one row per assistant turn "
              f"(the chat template renders earlier turns differently once the conversation goes on)")
    for bad in manifest["bad_rows"][:20]:
        print(f"  bad row {bad['where']}: " + (f"field '{bad['field']}' " if bad["field"] else "") + bad["reason"])
    if c["bad_rows"] > 20:
        print(f"  ... {c['bad_rows'] - 20:,} more in {cfg.output}/{manifest['bad_rows_file']}")
    if c["rows_kept"]:
        length = t["length"]
        print(f"lengths: min {length['min']:,}, mean {length['mean']:,.0f}, p50 {length['p50']:,.0f}, "
              f"p90 {length['p90']:,.0f}, p99 {length['p99']:,.0f}, max {length['max']:,}")
        lengths = TokenDataset(cfg.output).lengths
        budget = max(cfg.token_budget, int(lengths.max()))
        print(f"the batches a training run makes of it at data.plan.token_budget {budget:,} (--token-budget N shows "
              f"the plan for the budget your training config sets: {TRAIN_BUDGET:,} by default)")
        print(BatchPlanner(lengths, BatchPlanConfig(token_budget=budget)).describe())
    return 0
