"""`dflash-train <job>`: one subcommand per job.

Each job lives in its own module exposing `add_arguments(parser)` and `main(args) -> int`.
Modules are imported only when their job runs, so `dflash-train --help` stays instant
and a job's heavy imports (transformers, pyarrow) are paid only by that job.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# job name -> (module, one-line help)
JOBS: dict[str, tuple[str, str]] = {
    "prepare": ("dflash_train.data.prepare_cli", "tokenize conversations into Arrow shards"),
    "generate": ("dflash_train.generate.cli", "write training data with the target model itself"),
    "train": ("dflash_train.train.cli", "train a drafter against a frozen target"),
    "export": ("dflash_train.train.export_cli", "write the inference checkpoint of a training run"),
    "eval": ("dflash_train.eval.cli", "measure a drafter by real speculative decoding"),
    "bench": ("dflash_train.bench.cli", "measure training throughput on synthetic batches"),
    "demo": ("dflash_train.eval.demo", "train, export and evaluate a drafter for the built-in model"),
}


def build_parser() -> argparse.ArgumentParser:
    from dflash_train import __version__

    parser = argparse.ArgumentParser(
        prog="dflash-train",
        description="Train DFlash block-diffusion drafters for Hugging Face causal LMs.",
    )
    parser.add_argument("--version", action="version", version=f"dflash-train {__version__}")
    sub = parser.add_subparsers(dest="job", metavar="JOB")
    for name, (_, help_text) in JOBS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv or argv[0] not in JOBS:
        parser.parse_args(argv)  # prints help / version / the unknown-job error
        parser.print_help()
        return 2
    name, rest = argv[0], argv[1:]
    module_name, help_text = JOBS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("dflash_train"):
            print(f"dflash-train {name}: this job is not implemented yet", file=sys.stderr)
            return 2
        raise
    job_parser = argparse.ArgumentParser(prog=f"dflash-train {name}", description=help_text)
    module.add_arguments(job_parser)
    args = job_parser.parse_args(rest)
    return int(module.main(args) or 0)
