"""`dflash-train train --config run.yaml [--section.field value ...] [--resume]`."""

from __future__ import annotations

import argparse
import sys

from dflash_train.train.config import TrainConfig
from dflash_train.utils.config import ConfigError, add_config_arguments, load_config, overrides_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest complete checkpoint in run.output_dir")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    add_config_arguments(parser, TrainConfig)


def main(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(TrainConfig, args.config, overrides_from_args(args))
    except ConfigError as exc:
        print(f"error: invalid config: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        import yaml

        from dflash_train.utils.config import to_dict

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    from dflash_train.train.trainer import run_training

    return run_training(cfg, resume=args.resume)
