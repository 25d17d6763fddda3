"""Write the spec's inference checkpoint (config.json + model.safetensors) of a training run.

    dflash-train export runs/qwen3-8b --output drafters/qwen3-8b-dflash

Accepts a run directory (its newest checkpoint that verifies is used), one training
checkpoint (`.../checkpoints/step-00000500`), or an exported drafter directory. An
existing output is replaced only with --overwrite and only when export made it; never a
plain file, and never a directory that is or holds the source.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import SafetensorError

from dflash_train.drafter.checkpoint import CONFIG_NAME, WEIGHTS_NAME, load_drafter, save_drafter
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.train.checkpoint import STATE, latest_valid_checkpoint, step_dirs, verify_checkpoint
from dflash_train.utils.config import cli
from dflash_train.utils.device import DTYPES
from dflash_train.utils.errors import InputError, ModelError
from dflash_train.utils.fs import check_output_dir
from dflash_train.utils.signals import sigterm_interrupts

JOB = "export"


@dataclass
class ExportConfig:
    source: str = field(default="", metadata=cli(positional=True))
    """run directory, training checkpoint, or drafter directory"""
    output: str = field(default="", metadata=cli(aliases=("-o",)))
    """directory to write"""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the exported weights"""
    overwrite: bool = False
    """replace an existing output directory that an earlier export wrote"""

    def __post_init__(self) -> None:
        if not self.source or not self.output:
            raise ValueError("give the run/checkpoint directory and --output DIR")


CONFIG = ExportConfig


def find_drafter_dir(path: str | Path) -> Path:
    """The drafter directory inside `path`: `path` itself, a training checkpoint's (which
    must verify), or the newest checkpoint of a run that verifies (warnings for skipped ones)."""
    path = Path(path)
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    if (path / "drafter" / "config.json").is_file():
        if (path / STATE).is_file() and (problems := verify_checkpoint(path)):
            raise InputError(f"{path}: the checkpoint does not verify: {'; '.join(problems)}")
        return path / "drafter"
    for root in (path / "checkpoints", path):
        latest = latest_valid_checkpoint(root)
        if latest is not None:
            return latest / "drafter"
        if step_dirs(root, complete_only=False):
            raise InputError(f"{root}: none of its checkpoints verifies (see the warnings above)")
    raise InputError(f"{path}: no drafter, training checkpoint or run directory with checkpoints")


def _load(drafter_dir: Path) -> DFlashDrafter:
    try:
        return load_drafter(drafter_dir)
    except ModelError:  # its message names the folder and what is wrong
        raise
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        raise InputError(f"{drafter_dir}: the drafter does not load ({type(e).__name__}: {e})") from e


def export_drafter(drafter_dir: Path, output: str | Path, dtype: torch.dtype = torch.bfloat16, *,
                   overwrite: bool = False, sources: tuple[str | Path, ...] = ()) -> Path:
    """Write the drafter in `drafter_dir` to `output` (checked by `check_output_dir` first)."""
    out = check_output_dir(output, overwrite=overwrite, inputs=(drafter_dir, *sources), job=JOB)
    return save_drafter(_load(drafter_dir), out, dtype=dtype, job=JOB)


def export(source: str | Path, output: str | Path, dtype: torch.dtype = torch.bfloat16, *,
           overwrite: bool = False) -> Path:
    return export_drafter(find_drafter_dir(source), output, dtype, overwrite=overwrite, sources=(source,))


def run(cfg: ExportConfig, args: argparse.Namespace | None = None) -> int:
    drafter_dir = find_drafter_dir(cfg.source)
    with sigterm_interrupts():  # SIGTERM unwinds like Ctrl-C: the temporary folder goes, a line says why
        out = export_drafter(drafter_dir, cfg.output, DTYPES[cfg.dtype], overwrite=cfg.overwrite,
                             sources=(cfg.source,))
    print(f"exported {drafter_dir} -> {out} ({cfg.dtype})")
    if same_as_final(Path(cfg.source), out):
        print(f"{Path(cfg.source) / 'final'} holds the same drafter (a run that ends writes it there); export is "
              f"for a chosen checkpoint, another --dtype, a run stopped before its end, and a folder apart from the "
              f"run (that --resume never touches)")
    return 0


def same_as_final(source: Path, out: Path) -> bool:
    """Whether `source` is a run whose final/ holds byte for byte what export wrote to `out`."""
    final = source / "final"
    try:
        return all((final / name).read_bytes() == (out / name).read_bytes() for name in (CONFIG_NAME, WEIGHTS_NAME))
    except OSError:
        return False
