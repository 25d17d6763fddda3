"""`dflash-train generate`: write training data with the target model itself.

    dflash-train generate --target builtin --prompts data/chats.jsonl --output gen.jsonl
    dflash-train generate --synthesize 10000 --output synth.jsonl --temperature 0.7
    dflash-train generate --engine http --base-url http://localhost:8000/v1 --prompts p.jsonl --output gen.jsonl

Every field of `GenerateConfig` is an option, spelled `--max_new_tokens` or
`--max-new-tokens`; `--config run.yaml` reads them from a file (options override it).
Rerunning a command resumes it. See docs/generate.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import typing
from pathlib import Path

from dflash_train.generate.config import GenerateConfig
from dflash_train.utils.config import ConfigError, leaf_fields, load_config, overrides_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None, help="YAML file with GenerateConfig fields")
    for name, tp, help_text in leaf_fields(GenerateConfig):
        spellings = [f"--{name}"] + ([f"--{name.replace('_', '-')}"] if "_" in name else [])
        is_list = typing.get_origin(tp) is list
        parser.add_argument(
            *spellings,
            dest=f"cfg__{name}",
            default=argparse.SUPPRESS,
            nargs="+" if is_list else None,
            metavar="FILE" if is_list else name.upper(),
            help=help_text or None,
        )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(GenerateConfig, args.config, overrides_from_args(args))
    except ConfigError as exc:
        print(f"dflash-train generate: {exc}", file=sys.stderr)
        return 2
    from dflash_train.generate.tasks import run_generate

    try:
        summary = run_generate(cfg)
    except KeyboardInterrupt:
        print("interrupted; finished rows are saved, rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one clear line instead of a traceback for known failures
        from dflash_train.data.sources import DataError
        from dflash_train.generate.decoder import UnsupportedModelError
        from dflash_train.generate.http_engine import HttpEngineError
        from dflash_train.generate.writer import OutputBusyError

        known = (DataError, UnsupportedModelError, HttpEngineError, OutputBusyError, FileNotFoundError, ValueError)
        if isinstance(exc, known):
            print(f"dflash-train generate: error: {exc}", file=sys.stderr)
            if isinstance(exc, HttpEngineError):
                print("finished rows are saved; rerun the same command to resume", file=sys.stderr)
            return 1
        raise
    print(json.dumps(summary, indent=2))
    return 0
