"""Write the spec's inference checkpoint (config.json + model.safetensors) of a training run.

    dflash-train export runs/qwen3-8b --output drafters/qwen3-8b-dflash

Accepts a run directory (its latest complete checkpoint is used), one training
checkpoint (`.../checkpoints/step-00000500`), or an exported drafter directory.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from dflash_train.drafter.checkpoint import load_drafter, save_drafter
from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.utils.config import cli
from dflash_train.utils.device import DTYPES
from dflash_train.utils.errors import InputError


@dataclass
class ExportConfig:
    source: str = field(default="", metadata=cli(positional=True))
    """run directory, training checkpoint, or drafter directory"""
    output: str = field(default="", metadata=cli(aliases=("-o",)))
    """directory to write"""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the exported weights"""

    def __post_init__(self) -> None:
        if not self.source or not self.output:
            raise ValueError("give the run/checkpoint directory and --output DIR")


CONFIG = ExportConfig


def find_drafter_dir(path: str | Path) -> Path:
    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    if (path / "drafter" / "config.json").is_file():
        return path / "drafter"
    latest = latest_checkpoint(path / "checkpoints") or latest_checkpoint(path)
    if latest is not None:
        return latest / "drafter"
    raise InputError(f"{path}: no drafter, training checkpoint or run directory with checkpoints")


def export(source: str | Path, output: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    return save_drafter(load_drafter(find_drafter_dir(source)), Path(output), dtype=dtype)


def run(cfg: ExportConfig, args: argparse.Namespace | None = None) -> int:
    out = export(cfg.source, cfg.output, DTYPES[cfg.dtype])
    print(f"exported {find_drafter_dir(cfg.source)} -> {out} ({cfg.dtype})")
    return 0
