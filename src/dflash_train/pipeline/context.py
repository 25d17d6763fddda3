"""Who this process is in a run: its rank, role, device and process groups.

Launched by `torchrun` (one process per device, any number of nodes), ranks are laid out
as: split -> ranks 0..T-1 run targets, ranks T..T+D-1 run drafters; colocated -> every
rank does both. Process groups:

* `drafters`: the drafter ranks (NCCL on GPU, gloo on CPU): gradient all-reduce, the
  global loss normaliser, metrics, the agreed stop step.
* `control`: all ranks, gloo on CPU: small messages (credits, headers, stop requests)
  that must not wait behind GPU work.
* `data`: all ranks, NCCL, for GPU-to-GPU hidden states (split layout only).

The default group is created with a long timeout because loading a large target can
take minutes while other ranks wait at the first barrier; the working groups are created
after that barrier with `pipeline.timeout_s`, so a dead peer turns every blocked call
into an error within that time instead of a hang.
"""

from __future__ import annotations

import os
import socket
import zlib
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_train.pipeline.config import PipelineConfig
from dflash_train.utils.device import resolve_device
from dflash_train.utils.errors import ConfigError


@dataclass
class DistContext:
    layout: str  # single | colocated | split
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    target_ranks: list[int] = field(default_factory=lambda: [0])
    drafter_ranks: list[int] = field(default_factory=lambda: [0])
    drafters: object | None = None  # process group of the drafter ranks
    control: object | None = None  # gloo group of all ranks
    data: object | None = None  # NCCL group of all ranks (split, GPU)

    @property
    def is_target(self) -> bool:
        return self.rank in self.target_ranks

    @property
    def is_drafter(self) -> bool:
        return self.rank in self.drafter_ranks

    @property
    def num_drafters(self) -> int:
        return len(self.drafter_ranks)

    @property
    def num_targets(self) -> int:
        return len(self.target_ranks)

    @property
    def drafter_index(self) -> int:
        return self.drafter_ranks.index(self.rank)

    @property
    def target_index(self) -> int:
        return self.target_ranks.index(self.rank)

    @property
    def is_main_drafter(self) -> bool:
        return self.rank == self.drafter_ranks[0]

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def target_of(self, global_index: int) -> int:
        """Rank of the target that produces batch `global_index` (split layout)."""
        return self.target_ranks[global_index % self.num_targets]

    def drafter_of(self, global_index: int) -> int:
        return self.drafter_ranks[global_index % self.num_drafters]


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def resolve_layout(cfg: PipelineConfig) -> str:
    if cfg.layout != "auto":
        return cfg.layout
    return "colocated" if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1 else "single"


def init_distributed(cfg: PipelineConfig, device_name: str) -> DistContext:
    """Create the context for this process (and the process groups when distributed)."""
    layout = resolve_layout(cfg)
    if layout == "single":
        if launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1:
            raise ConfigError("pipeline.layout=single under torchrun with several processes: use colocated or split")
        return DistContext(layout="single", device=resolve_device(device_name))
    if not launched_by_torchrun():
        raise ConfigError(f"pipeline.layout={layout} needs several processes: launch with torchrun "
                         f"(see docs/pipeline.md)")
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if layout == "split":
        if cfg.target_ranks + cfg.drafter_ranks != world:
            raise ConfigError(f"pipeline.target_ranks ({cfg.target_ranks}) + pipeline.drafter_ranks "
                             f"({cfg.drafter_ranks}) must equal the number of processes ({world})")
        targets, drafters = list(range(cfg.target_ranks)), list(range(cfg.target_ranks, world))
    else:
        targets = drafters = list(range(world))
    device = resolve_device(device_name, local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=cfg.startup_timeout_s))
    working = timedelta(seconds=cfg.timeout_s)
    ctx = DistContext(layout=layout, rank=rank, world=world, local_rank=local, device=device,
                      target_ranks=targets, drafter_ranks=drafters)
    ctx.control = dist.new_group(backend="gloo", timeout=working)
    ctx.drafters = dist.new_group(drafters, backend="nccl" if device.type == "cuda" else "gloo", timeout=working)
    if layout == "split" and _device_transport(cfg.transport, ctx):
        ctx.data = dist.new_group(backend="nccl", timeout=working)
    return ctx


def _device_transport(transport: str, ctx: DistContext) -> bool:
    """Whether hidden states go GPU to GPU over NCCL (`pipeline.transport`): `host` never,
    `device` always (an error where NCCL cannot: CPU ranks, two ranks on one GPU), `auto`
    whenever it can."""
    if transport == "host":
        return False
    possible = ctx.device.type == "cuda" and _devices_distinct(ctx)  # collective: every rank asks
    if transport == "device" and not possible:
        raise ConfigError("pipeline.transport=device needs every rank on its own GPU; use host or auto")
    return possible


def _devices_distinct(ctx: DistContext) -> bool:
    """Whether every rank has its own GPU (NCCL refuses two ranks on one device)."""
    mine = torch.tensor([ctx.device.index if ctx.device.type == "cuda" else -1, _host_id()], dtype=torch.long)
    everyone = [torch.zeros_like(mine) for _ in range(ctx.world)]
    dist.all_gather(everyone, mine, group=ctx.control)
    keys = [tuple(t.tolist()) for t in everyone]
    return len(set(keys)) == len(keys)


def _host_id() -> int:
    return zlib.crc32(socket.gethostname().encode()) & 0x7FFFFFFF


def shutdown(ctx: DistContext) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
