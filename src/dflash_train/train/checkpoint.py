"""Training checkpoints that survive anything, SIGKILL mid-save included.

    <output_dir>/checkpoints/step-00000120/
        drafter/               the spec's inference checkpoint, fp32 (export copies it)
        optimizer.pt           optimizer state (tensors only: loads with weights_only=True)
        rng.pt                 torch / CUDA generator states
        state.json             step, data cursor, scheduler, counters, numpy/python RNG
        config.yaml            the resolved training config

Each checkpoint is written into a temporary directory and renamed into place, so a
directory named `step-*` is always complete; `latest_checkpoint` also ignores anything
without `state.json` (written last). Only the newest `keep_last` are kept.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from dflash_train.drafter.checkpoint import load_drafter, save_drafter
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.utils.errors import TrainingError
from dflash_train.utils.fs import atomic_directory_write

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE = "state.json"


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs to continue exactly."""

    step: int = 0  # optimizer steps done
    epoch: int = 0  # data cursor: the next batch to read is (epoch, index)
    index: int = 0
    tokens: int = 0  # sequence tokens consumed
    batches: int = 0  # micro-batches consumed (skipped steps included)
    bad_steps_total: int = 0
    elapsed_s: float = 0.0


def capture_rng() -> tuple[dict, dict]:
    """(tensor states for rng.pt, JSON-able states for state.json)."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.stack(torch.cuda.get_rng_state_all())
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    plain = {"numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
             "python": _to_lists(random.getstate())}
    return tensors, plain


def restore_rng(tensors: dict, plain: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available() and len(tensors["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(list(tensors["cuda"]))
    kind, keys, pos, has_gauss, gauss = plain["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    random.setstate(_to_tuples(plain["python"]))


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / STATE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> Path | None:
    found = step_dirs(Path(root))
    return found[-1][1] if found else None


def save_checkpoint(
    root: Path,
    *,
    drafter: DFlashDrafter,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    config: dict,
    keep_last: int,
) -> Path:
    rng_tensors, rng_plain = capture_rng()
    payload = {
        "train_state": state.__dict__,
        "scheduler": scheduler.state_dict(),
        "rng": rng_plain,
    }
    opt_state = optimizer.state_dict()

    def write(tmp: Path) -> None:
        save_drafter(drafter, tmp / "drafter", dtype=torch.float32)
        torch.save(opt_state, tmp / "optimizer.pt")
        torch.save(rng_tensors, tmp / "rng.pt")
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (tmp / STATE).write_text(json.dumps(payload, indent=1))  # last: marks the checkpoint complete

    path = atomic_directory_write(Path(root) / f"step-{state.step:08d}", write)
    for _, old in step_dirs(Path(root))[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return path


def load_checkpoint(path: Path, *, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer, scheduler: Any) -> TrainState:
    """Restore everything into the given objects; returns the TrainState."""
    path = Path(path)
    payload = json.loads((path / STATE).read_text())
    saved = load_drafter(path / "drafter")
    if saved.config != drafter.config:
        raise TrainingError(f"{path}: the checkpoint's drafter config differs from this run's; "
                         f"start a new output_dir or use the same config")
    drafter.load_state_dict(saved.state_dict())
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    scheduler.load_state_dict(payload["scheduler"])
    restore_rng(torch.load(path / "rng.pt", map_location="cpu", weights_only=True), payload["rng"])
    return TrainState(**payload["train_state"])
