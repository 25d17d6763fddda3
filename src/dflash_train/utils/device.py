"""Devices, dtypes and CPU threads: the one place that turns config strings into torch objects."""

from __future__ import annotations

import os
import time
from typing import Literal

import torch

from dflash_train.utils.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DtypeName = Literal["auto", "bfloat16", "float16", "float32"]


def resolve_device(name: str = "auto", local_rank: int = 0) -> torch.device:
    """`auto` -> this process's GPU (local rank modulo the visible GPUs; several processes
    may share one) or the CPU; `cuda` without an index -> this process's GPU too (under
    torchrun every rank gets the same command line); otherwise the named device, checked
    to exist."""
    if name == "auto" and not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        device = torch.device("cuda" if name == "auto" else name)
    except RuntimeError:
        raise ConfigError(f"unknown device {name!r}: use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name} was asked for but no CUDA device is available")
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` -> bfloat16 on GPU, float32 on CPU; otherwise the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype {name!r}: use auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`, the host never waiting for it: a CPU tensor bound for a GPU is pinned
    first, since a copy from pageable memory is staged by the host and may wait on the stream
    (a GPU idle gap at each step's start); from pinned memory it is queued and returns."""
    if torch.device(device).type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)


def copy_values_async(dst: torch.Tensor, values: list) -> torch.Tensor:
    """Python `values` into `dst` (a buffer of as many elements, of its dtype) by one copy the
    host does not wait for: from pinned memory when `dst` is on a GPU, straight into it (no
    device-side staging tensor). Returns `dst`."""
    src = torch.tensor(values, dtype=dst.dtype)
    return dst.copy_(src.pin_memory() if dst.device.type == "cuda" else src, non_blocking=True)


class HostCopy:
    """A small device tensor's value read back without draining the queue behind it.

    `.item()` copies on the tensor's stream, so it waits for every kernel queued before the
    call, and the GPU then idles until the host launches again. Started right after the value
    is computed, this copy is waited for alone (an event), so kernels queued after it keep the
    GPU busy while the host reads the value and decides. On CPU it is a plain read."""

    def __init__(self, value: torch.Tensor):
        if value.device.type == "cuda":
            self._host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            self._host.copy_(value, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(value.device))
        else:
            self._host, self._ready = value.detach().clone(), None

    def get(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host


def busy_cores_elsewhere(window_s: float = 0.5) -> float | None:
    """Cores kept busy by other processes right now (Linux /proc/stat), or None if unknown."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:9]]
        return sum(values), values[3] + values[4]  # total, idle + iowait (jiffies over all cores)

    try:
        total0, idle0 = sample()
        self0 = sum(os.times()[:2])
        time.sleep(window_s)
        total1, idle1 = sample()
        self1 = sum(os.times()[:2])
    except (OSError, ValueError, IndexError):
        return None
    cores = os.cpu_count() or 1
    if total1 <= total0:
        return None
    busy = cores * (1 - (idle1 - idle0) / (total1 - total0))  # cores busy on the whole machine
    return max(0.0, busy - (self1 - self0) / window_s)


def idle_cores() -> int:
    """Cores that other processes leave idle right now (at least 1): how many worker
    processes a CPU-bound job starts by default."""
    cores = os.cpu_count() or 1
    busy = busy_cores_elsewhere() or 0.0
    return max(1, int(cores - busy + 0.5))


def choose_cpu_threads(requested: int = 0, ranks_on_node: int | None = None) -> tuple[int, str]:
    """Torch CPU threads: `requested`, or (0) as many cores as other processes leave idle, and
    at most this rank's share of the cores when several ranks run on the node.

    OpenMP threads wait for each other at every parallel region: when another process
    holds one of the cores, a 2-thread matmul ran 10-30x slower than a 1-thread one on a
    shared 2-core machine. So the threads are fitted to the cores idle right now. Ranks
    started together each see every core idle, so each gets cores // ranks on the node
    (LOCAL_WORLD_SIZE by default): 4 ranks of 16 threads on 16 cores spin against each other.
    """
    if requested:
        torch.set_num_threads(requested)
        return requested, "as requested"
    ranks = ranks_on_node if ranks_on_node is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    cores = torch.get_num_threads()
    if ranks > 1:  # the other ranks are the "other processes": a share each, whatever they do right now
        share = min(cores, max(1, (os.cpu_count() or cores) // ranks))
        torch.set_num_threads(share)
        return share, f"{ranks} ranks share this node's cores; --threads overrides"
    busy = busy_cores_elsewhere()
    if busy is None:
        return cores, "default"
    free = max(1, min(cores, int(cores - busy + 0.5)))
    if free < cores:
        torch.set_num_threads(free)
        return free, f"other processes keep {busy:.1f} of {cores} cores busy; --threads overrides"
    return cores, "all cores idle"


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing on CPU)."""
    if torch.device(device).type == "cuda":  # pragma: no cover
        torch.cuda.synchronize()
