"""`dflash-train export RUN_DIR|CHECKPOINT_DIR --output DIR`: the spec's inference checkpoint.

Accepts a run directory (its latest complete checkpoint is used), one training
checkpoint (`.../checkpoints/step-00000500`), or an exported drafter directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def find_drafter_dir(path: Path) -> Path:
    from dflash_train.train.checkpoint import latest_checkpoint

    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    if (path / "drafter" / "config.json").is_file():
        return path / "drafter"
    latest = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
    if latest is not None:
        return latest / "drafter"
    raise FileNotFoundError(f"{path}: no drafter, training checkpoint or run directory with checkpoints")


def export(source: Path, output: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    from dflash_train.drafter.checkpoint import load_drafter, save_drafter

    return save_drafter(load_drafter(find_drafter_dir(source)), output, dtype=dtype)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", type=Path, help="run directory, training checkpoint, or drafter directory")
    parser.add_argument("--output", "-o", type=Path, required=True, help="directory to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")


def main(args: argparse.Namespace) -> int:
    try:
        out = export(args.source, args.output, DTYPES[args.dtype])
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {find_drafter_dir(args.source)} -> {out} ({args.dtype})")
    return 0
