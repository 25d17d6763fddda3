"""`dflash-train <job>`: one subcommand per job, one config system, one error policy.

Each job module exposes `CONFIG` (its dataclass config class), `run(cfg, args) -> int`
and optionally `add_arguments(parser)` for flags that are not config (`train --resume`).
Every job therefore takes `--config FILE`, one option per config field, `--print-config`
and `--debug`. Job modules are imported only when their job runs, so `dflash-train --help`
stays instant and a job's heavy imports are paid only by that job.

Errors: a `DFlashError` (bad input, config, data, model) prints one line and exits 2
(`--debug` adds the traceback); anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import logging
import os
import sys

from dflash_train import __version__
from dflash_train.utils.config import dump_yaml, leaf_fields
from dflash_train.utils.config_cli import add_config_arguments, config_from_args, normalize_argv
from dflash_train.utils.errors import EXIT_INTERRUPTED, EXIT_USER_ERROR, DFlashError, storage_error
from dflash_train.utils.log import setup_logging
from dflash_train.utils.signals import Terminated

log = logging.getLogger("dflash_train.cli")

# job name -> (module, one-line help)
JOBS: dict[str, tuple[str, str]] = {
    "prompts": ("dflash_train.data.prompts_cli", "build training prompt files from offline sources (code, docs, math)"),
    "prepare": ("dflash_train.data.prepare_cli", "tokenize conversations into Arrow shards"),
    "generate": ("dflash_train.generate.cli", "write training data with the target model itself"),
    "train": ("dflash_train.train.cli", "train a drafter against a frozen target"),
    "export": ("dflash_train.train.export_cli", "write the inference checkpoint of a training run"),
    "eval": ("dflash_train.eval.cli", "measure a drafter by real speculative decoding"),
    "bench": ("dflash_train.bench.cli", "measure training throughput on synthetic batches"),
    "demo": ("dflash_train.eval.demo", "train, export and evaluate a drafter for the built-in model"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train DFlash block-diffusion drafters for Hugging Face causal LMs.",
    )
    parser.add_argument("--version", action="version", version=f"dflash-train {__version__}")
    sub = parser.add_subparsers(dest="job", metavar="JOB")
    for name, (_, help_text) in JOBS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


class JobParser(argparse.ArgumentParser):
    """argparse, plus the closest known option for each unrecognized one (a mistyped flag)."""

    def error(self, message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            message += "".join(_suggestion(self, arg) for arg in message[len(prefix):].split())
        super().error(message)


def _suggestion(parser: argparse.ArgumentParser, arg: str) -> str:
    if not arg.startswith("--"):
        return ""
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    close = difflib.get_close_matches(arg.split("=", 1)[0], known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def build_job_parser(name: str, module) -> argparse.ArgumentParser:
    doc = (module.__doc__ or "").strip()
    positional = " ".join(leaf.name.upper() + (" ..." if "list" in str(leaf.type) else "")
                          for leaf in leaf_fields(module.CONFIG) if leaf.positional)
    parser = JobParser(prog=f"dflash-train {name}", description=doc or JOBS[name][1],
                                     usage=f"%(prog)s [--config FILE] [options] {positional}".rstrip(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--debug", action="store_true", help="show the traceback of errors and DEBUG log lines")
    add_config_arguments(parser, module.CONFIG)
    if hasattr(module, "add_arguments"):
        module.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in JOBS:
        parser = build_parser()
        parser.parse_args(argv)  # prints help / version / the unknown-job error
        parser.print_help()
        return EXIT_USER_ERROR
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(JOBS[name][0])
    args = build_job_parser(name, module).parse_intermixed_args(normalize_argv(rest, module.CONFIG))
    setup_logging(logging.DEBUG if args.debug else logging.INFO)
    cfg = None
    try:
        cfg = config_from_args(module.CONFIG, args)
        if args.print_config:
            print(dump_yaml(cfg))
            return 0
        return int(module.run(cfg, args) or 0)
    except DFlashError as exc:
        return _user_error(name, exc, args.debug)
    except BrokenPipeError:  # `dflash-train prepare ... | head`: the reader left; nothing is lost
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a full disk or a read-only output is the user's to fix; any other OSError is a bug
        user = storage_error(exc, getattr(cfg, "output", None))
        if user is None:
            raise
        return _user_error(name, user, args.debug)
    except Terminated as exc:
        print(f"dflash-train {name}: stopped by SIGTERM before it finished; nothing half-written is left",
              file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"dflash-train {name}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _user_error(name: str, exc: DFlashError, debug: bool) -> int:
    if debug:
        log.exception("the error's traceback:")
    print(f"dflash-train {name}: error: {exc}", file=sys.stderr, flush=True)
    return EXIT_USER_ERROR
