"""`dflash-train prepare`: tokenize conversations into Arrow shards.

    dflash-train prepare --target builtin data/chats.jsonl --output runs/data --max-length 8192
"""

from __future__ import annotations

import argparse
import sys

from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.data.sources import DataError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", help="JSONL / JSON / Parquet files or directories of them")
    parser.add_argument("--target", default="builtin",
                        help="whose tokenizer and chat template: a model directory, a .gguf file, a directory "
                             "with tokenizer files only, or 'builtin' (default)")
    parser.add_argument("--output", "-o", required=True, help="output directory (must not exist unless --overwrite)")
    parser.add_argument("--max-length", type=int, default=8192, help="maximum tokens per row (default 8192)")
    parser.add_argument("--overflow", choices=["truncate", "drop"], default="truncate",
                        help="what to do with longer rows (default truncate); either way they are counted")
    parser.add_argument("--skip-bad-rows", action="store_true",
                        help="count and list malformed rows instead of stopping at the first one")
    parser.add_argument("--workers", type=int, default=0, help="tokenizer processes (default: cores - 1; 1 = in-process, "
                             "with the tokenizer's own threads)")
    parser.add_argument("--shard-size", type=int, default=100_000, help="rows per shard file (default 100000)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="a Jinja chat template to use instead of the tokenizer's")
    parser.add_argument("--text-eos", action="store_true", help="append EOS to plain-text rows")
    parser.add_argument("--token-budget", type=int, default=49152,
                        help="only for the batch table printed at the end (default 49152)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    try:
        cfg = PrepareConfig(
            target=args.target, inputs=list(args.inputs), output=args.output, max_length=args.max_length,
            overflow=args.overflow, skip_bad_rows=args.skip_bad_rows, workers=args.workers,
            shard_size=args.shard_size, overwrite=args.overwrite, chat_template=args.chat_template,
            text_eos=args.text_eos, progress=not args.no_progress,
        )
        manifest = prepare(cfg)
    except (DataError, FileExistsError, FileNotFoundError, ValueError) as exc:
        hint = "  (pass --skip-bad-rows to skip such rows)" if isinstance(exc, DataError) else ""
        print(f"dflash-train prepare: error: {exc}{hint}", file=sys.stderr)
        return 1

    c, t = manifest["counts"], manifest["tokens"]
    print(f"wrote {c['rows_kept']:,} rows ({t['total']:,} tokens, {t['loss']:,} loss tokens) "
          f"in {len(manifest['shards'])} shard(s) to {cfg.output} in {manifest['seconds']:.1f} s")
    print(f"read {c['rows_read']:,} rows: {c['truncated']:,} truncated, {c['dropped_too_long']:,} dropped as too long, "
          f"{c['dropped_no_loss']:,} dropped with no loss tokens, {c['bad_rows']:,} bad")
    for bad in manifest["bad_rows"][:20]:
        print(f"  bad row {bad['where']}: " + (f"field '{bad['field']}' " if bad["field"] else "") + bad["reason"])
    if c["bad_rows"] > 20:
        print(f"  ... {c['bad_rows'] - 20:,} more in {cfg.output}/{manifest['bad_rows_file']}")
    if c["rows_kept"]:
        length = t["length"]
        print(f"lengths: min {length['min']:,}, mean {length['mean']:,.0f}, p50 {length['p50']:,.0f}, "
              f"p90 {length['p90']:,.0f}, p99 {length['p99']:,.0f}, max {length['max']:,}")
        from dflash_train.data.batching import BatchPlanConfig, BatchPlanner
        from dflash_train.data.dataset import TokenDataset

        lengths = TokenDataset(cfg.output).lengths
        budget = max(args.token_budget, int(lengths.max()))
        print(BatchPlanner(lengths, BatchPlanConfig(token_budget=budget)).describe())
    return 0
