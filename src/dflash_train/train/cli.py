"""Train a drafter against a frozen target.

    dflash-train train --config run.yaml --optim.lr 3e-4 --run.max_steps 2000
    torchrun --nproc-per-node 8 -m dflash_train train --config run.yaml --pipeline.layout split \\
        --pipeline.target_ranks 5 --pipeline.drafter_ranks 3

The whole config is validated before any model or dataset is opened; the resolved config
is saved next to the checkpoints. Stopped by Ctrl-C or SIGTERM, a run saves a checkpoint
and continues with `--resume` (an error when there is nothing to continue from;
`--resume auto` starts from scratch then).
"""

from __future__ import annotations

import argparse

from dflash_train.train.config import TrainConfig
from dflash_train.train.run import run_training
from dflash_train.utils.errors import ConfigError

CONFIG = TrainConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", nargs="?", const=True, default=False, type=_resume_mode, metavar="auto",
                        help="continue from the newest complete checkpoint in run.output_dir (an error when there is "
                             "none); `--resume auto`: continue if there is one, else start from scratch")


def _resume_mode(value: str) -> str:
    if value != "auto":
        raise argparse.ArgumentTypeError(f"takes no value or `auto`, got {value!r}")
    return value


def run(cfg: TrainConfig, args: argparse.Namespace) -> int:
    if not cfg.data.path:  # checked here, not in the config: `--print-config` shows the defaults without a dataset
        raise ConfigError("data.path is required: a dataset directory written by `dflash-train prepare` "
                          "(--data.path DIR)")
    return run_training(cfg, resume=args.resume)
