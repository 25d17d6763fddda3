"""Training checkpoints that survive anything, SIGKILL mid-save included.

    <output_dir>/checkpoints/step-00000120/
        drafter/               the spec's inference checkpoint, fp32 (export copies it)
        optimizer.pt           optimizer state (tensors only: loads with weights_only=True)
        rng.pt                 torch / CUDA generator states
        state.json             step, data cursor, scheduler, counters, numpy/python RNG
        config.yaml            the resolved training config
        .dflash-train          marker: a directory dflash-train made (utils/fs.py)
        manifest.json          size and CRC-32 of every file above; written last

Each checkpoint is written into a temporary directory and renamed into place, so a
directory named `step-*` is complete when written; `latest_checkpoint` ignores anything
without `state.json`. What happens to it afterwards (a truncated copy, a bad disk) is
caught by `verify_checkpoint`, and `--resume` takes `latest_valid_checkpoint`: the newest
one that verifies, with a warning for each newer one skipped. Checkpoints written before
manifests existed are accepted when their files load. Only the newest `keep_last` are kept.

`Checkpointer` keeps the run's saving time: every run.save_every steps, when a timed save
(run.save_every_minutes) is due, and at the end of the run.
"""

from __future__ import annotations

import json
import logging
import pickle
import random
import re
import shutil
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from safetensors import SafetensorError, safe_open

from dflash_train.drafter.checkpoint import load_drafter, save_drafter
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.utils.errors import ModelError, TrainingError
from dflash_train.utils.fs import atomic_directory_write, remove_stale_temp_dirs

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE = "state.json"
MANIFEST = "manifest.json"
# What a file that does not load looks like: missing, truncated zip or pickle, bad header or JSON.
LOAD_ERRORS = (OSError, ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError, SafetensorError,
               ModelError)


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
    fitted_total: int = 0  # the schedule's length fitted to the time box (run.fit_schedule); 0 = not fitted


def capture_rng() -> tuple[dict, dict]:
    """(tensor states for rng.pt, JSON-able states for state.json)."""
    tensors = {"torch": torch.get_rng_state()}
    # Only a process that uses CUDA has CUDA generators to keep: asking for them creates a CUDA
    # context, so every rank of a CPU run on a GPU machine would take a context (seconds and
    # ~0.5 GB each, all ranks at once on one GPU) at its first checkpoint.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
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


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_dirs(root: Path, *, complete_only: bool = True) -> list[tuple[int, Path]]:
    """(step, path) of the `step-*` directories under `root`, oldest first; with
    `complete_only`, only those with `state.json`."""
    root = Path(root)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and p.is_dir() and (not complete_only or (p / STATE).is_file()):
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint (it has `state.json`), not verified: for callers that
    only need to know whether a run has checkpoints. Resuming uses `latest_valid_checkpoint`."""
    found = step_dirs(Path(root))
    return found[-1][1] if found else None


def latest_valid_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint under `root` that verifies, or None. Each newer one that does
    not is skipped with a warning saying why."""
    for _, path in reversed(step_dirs(Path(root), complete_only=False)):
        problems = verify_checkpoint(path)
        if not problems:
            return path
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems))
    return None


# -- manifest and verification -------------------------------------------------------------------

# CRC-32, not a cryptographic hash: checkpoints are gigabytes, hashed at every save and
# every resume, and what we guard against is accidental (torn or truncated copies, bad
# disks), not forgery. zlib.crc32 runs ~2 GB/s on one core, sha256 ~0.9, blake2b ~0.4.
# The size is recorded as well, so a truncated file is reported as such.
CHECKSUM = "crc32"


def file_crc32(file: Path) -> str:
    crc = 0
    with open(file, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_manifest(directory: Path) -> None:
    """Record size and checksum of every file in `directory`; call it after the last write."""
    directory = Path(directory)
    files = {f.relative_to(directory).as_posix(): {"size": f.stat().st_size, CHECKSUM: file_crc32(f)}
             for f in sorted(directory.rglob("*")) if f.is_file() and f.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"checksum": CHECKSUM, "files": files}, indent=1) + "\n")


def verify_checkpoint(path: Path) -> list[str]:
    """What is wrong with the checkpoint at `path` (missing, truncated or corrupt files); []
    when it verifies. Without a manifest (checkpoints of earlier versions), its files must load."""
    path = Path(path)
    if not (path / STATE).is_file():
        return [f"{STATE} is missing"]
    if not (path / MANIFEST).is_file():
        return _files_that_do_not_load(path)
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        return [problem for name, want in files.items() if (problem := _file_problem(path / name, name, want))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"]


def _file_problem(file: Path, name: str, want: dict) -> str | None:
    try:
        size = file.stat().st_size
        if size < want["size"]:
            return f"{name} is truncated ({size} of {want['size']} bytes)"
        if size > want["size"]:
            return f"{name} has {size} bytes, {want['size']} expected"
        if file_crc32(file) != want[CHECKSUM]:
            return f"{name} is corrupt (checksum mismatch)"
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror or e})"
    return None


def _files_that_do_not_load(path: Path) -> list[str]:
    def load_safetensors(f: Path) -> None:
        with safe_open(str(f), framework="pt") as st:  # the header check catches truncation
            st.keys()

    def load_torch(f: Path) -> None:
        torch.load(f, map_location="cpu", weights_only=True, mmap=True)  # mmap: no copy of GBs in memory

    def load_json(f: Path) -> None:
        json.loads(f.read_text())

    checks = {STATE: load_json, "drafter/config.json": load_json, "drafter/model.safetensors": load_safetensors,
              "optimizer.pt": load_torch, "rng.pt": load_torch}
    problems = []
    for name, load in checks.items():
        if not (path / name).is_file():
            problems.append(f"{name} is missing")
            continue
        try:
            load(path / name)
        except LOAD_ERRORS as e:
            problems.append(f"{name} does not load ({type(e).__name__}: {e})")
    return problems


# -- save and load -------------------------------------------------------------------------------


def _torch_save(obj: Any, file: Path) -> None:
    # Through a Python file object: a failed write (disk full) raises OSError with its errno,
    # where torch.save(path) raises a RuntimeError from its C++ writer.
    with open(file, "wb") as fh:
        torch.save(obj, fh)


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
    """Write `root/step-NNNNNNNN` atomically. A failed write (disk full) raises TrainingError
    naming it and leaves the earlier checkpoints as they were, with no temp directory."""
    root = Path(root)
    rng_tensors, rng_plain = capture_rng()
    payload = {
        "train_state": state.__dict__,
        "scheduler": scheduler.state_dict(),
        "rng": rng_plain,
    }
    opt_state = optimizer.state_dict()

    def write(tmp: Path) -> None:
        save_drafter(drafter, tmp / "drafter", dtype=torch.float32)
        _torch_save(opt_state, tmp / "optimizer.pt")
        _torch_save(rng_tensors, tmp / "rng.pt")
        (tmp / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        (tmp / STATE).write_text(json.dumps(payload, indent=1))
        write_manifest(tmp)  # last: sizes and checksums of everything above

    final = root / step_dir_name(state.step)
    remove_stale_temp_dirs(root)  # killed saves of any step, not only of this one
    try:
        path = atomic_directory_write(final, write, job="checkpoint")
    except (OSError, SafetensorError) as e:
        previous = latest_checkpoint(root)
        raise TrainingError(f"{final}: could not write the checkpoint ({e}); "
                            f"{f'the previous one, {previous}, is kept' if previous else 'no earlier checkpoint'}: "
                            f"free disk space (or fix the error) and run again with --resume") from e
    _prune(root, keep_last, saved_step=state.step)
    return path


def _prune(root: Path, keep_last: int, *, saved_step: int) -> None:
    """Keep the newest `keep_last` checkpoints up to the one just saved. Newer ones exist
    only when resuming skipped them (they did not verify): leave those to be replaced when
    this run saves that step, rather than delete the one just written."""
    upto_saved = [p for step, p in step_dirs(root) if step <= saved_step]
    for old in upto_saved[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: Path, *, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer, scheduler: Any) -> TrainState:
    """Restore everything into the given objects; returns the TrainState. A checkpoint that
    does not load or does not fit this run raises TrainingError naming it."""
    path = Path(path)
    try:
        payload = json.loads((path / STATE).read_text())
        saved = load_drafter(path / "drafter")
        optimizer_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
        rng_tensors = torch.load(path / "rng.pt", map_location="cpu", weights_only=True)
    except LOAD_ERRORS as e:
        raise TrainingError(f"{path}: the checkpoint does not load ({type(e).__name__}: {e}); move it away "
                            f"to resume from the one before") from e
    if saved.config != drafter.config:
        raise TrainingError(f"{path}: the checkpoint's drafter config differs from this run's; "
                            f"start a new output_dir or use the same config")
    try:
        drafter.load_state_dict(saved.state_dict())
        optimizer.load_state_dict(optimizer_state)
        scheduler.load_state_dict(payload["scheduler"])
        restore_rng(rng_tensors, payload["rng"])
        return TrainState(**payload["train_state"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise TrainingError(f"{path}: the checkpoint does not fit this run ({type(e).__name__}: {e}); resume with "
                            f"the config the run was started with, or start a new output_dir") from e


def checkpoint_to_resume(root: Path, resume: bool | str) -> Path | None:
    """Where a run in `root` starts: the newest checkpoint that verifies with --resume (newer
    ones that do not are skipped with a warning), nothing without it; an error when that
    would lose or misuse existing checkpoints. `--resume` with no checkpoint at all is an
    error too (a typo in run.output_dir, or a stop that saved nothing, would otherwise
    silently train again from step 0); `--resume auto` starts fresh then."""
    if not resume:
        if latest_checkpoint(root) is not None:
            raise TrainingError(f"{root} already holds checkpoints: pass --resume to continue that run, "
                                f"or choose another run.output_dir")
        return None
    found = latest_valid_checkpoint(root)
    if found is None and step_dirs(root, complete_only=False):
        # starting over would later prune them: the user decides what to do with them
        raise TrainingError(f"{root}: none of its checkpoints verifies (see the warnings above); "
                            f"move them away to start from scratch")
    if found is None and resume != "auto":
        raise TrainingError(f"--resume: no checkpoint in {root} to continue from; check run.output_dir, or pass "
                            f"--resume auto to start from scratch when there is none")
    if found is None:
        log.info("--resume auto: no checkpoint in %s; starting from scratch", root)
    return found


class Checkpointer:
    """When and where a run's checkpoints are written. Every drafter replica reaches the same save
    points (the timed one is agreed in the step's all-reduce, train/stopping.py); only the main
    drafter writes, since data-parallel replicas hold the same weights, and its clock times the
    timed saves."""

    def __init__(self, root: Path, *, drafter: DFlashDrafter, optimizer: torch.optim.Optimizer, scheduler: Any,
                 config: dict, every: int, every_minutes: float = 0.0, keep_last: int, main: bool = True,
                 enabled: bool = True):
        self.root = Path(root)
        self.drafter, self.optimizer, self.scheduler, self.config = drafter, optimizer, scheduler, config
        self.every, self.every_minutes, self.keep_last = every, every_minutes, keep_last
        self.main = main
        self.writes = main and enabled  # run.checkpoint false: the save points pass, nothing is written
        self.last_save = time.perf_counter()  # the timed saves count from here, then from each save point

    def timed_save_due(self) -> bool:
        """run.save_every_minutes have passed since the last save point, on the main drafter's clock."""
        return (bool(self.every_minutes) and self.main
                and (time.perf_counter() - self.last_save) / 60 >= self.every_minutes)

    def maybe_save(self, state: TrainState, say: Callable[[str], None], *, due: bool = False,
                   last: bool = False) -> Path | None:
        """Save at every `every`-th step, when `due` (the agreed timed save) and at the `last` step of a
        run; the checkpoint's path where this process has one, else None."""
        if last or due or state.step % self.every == 0:
            return self.save(state, say)
        return None

    def save(self, state: TrainState, say: Callable[[str], None]) -> Path | None:
        """A checkpoint of `state` now, said through `say`; a verified one of this step is not written again."""
        self.last_save = time.perf_counter()
        if not self.writes:
            return None
        saved = self.root / step_dir_name(state.step)
        if saved.is_dir() and not verify_checkpoint(saved):
            return saved  # this step is saved already (the last step was a save_every step)
        path = save_checkpoint(self.root, drafter=self.drafter, optimizer=self.optimizer, scheduler=self.scheduler,
                               state=state, config=self.config, keep_last=self.keep_last)
        say(f"saved {path}")
        return path
