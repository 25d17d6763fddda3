"""Who this process is in a run: its rank, role, device and process groups.

Launched by `torchrun` (one process per device, any number of nodes), ranks are laid out
as: split -> ranks 0..T-1 run targets, ranks T..T+D-1 run drafters; colocated -> every
rank does both. Process groups:

* `drafters`: the drafter ranks (NCCL on GPU, gloo on CPU): gradient all-reduce, the
  global loss normaliser, metrics, the agreed stop step.
* `control`: all ranks, gloo on CPU: small messages (credits, headers, stop requests)
  that must not wait behind GPU work.
* `links`: one group per (target, drafter) pair that exchanges hidden states (split
  layout): NCCL GPU to GPU (`device` transport), gloo through host memory (`host`).
* `target_group` (pipeline.target_group_size G > 1): the G consecutive target ranks that
  hold one sharded copy of the target (FSDP2's all-gathers: NCCL on GPU, gloo on CPU), and
  `target_group_control`, a gloo group of the same ranks (a split layout's target ranks
  agree there, once a batch, whether the group runs a forward: pipeline/target_group.py).

Why one group per pair, created and connected at start-up: NCCL creates the
communicator of a group at its first operation, a handshake both peers must enter. Left
to the first transfer, a drafter blocked in that handshake and a target blocked waiting
for the drafter's credit on the control group wait for each other forever
(docs/pipeline.md, "What moves between ranks").
So every rank creates the pair groups in one global order and connects each with one
batched exchange, in the same order, before any credit is sent: a rank only waits for a
pair whose two members have finished every earlier pair, so the start-up cannot
deadlock, and afterwards no transfer creates anything. One group per pair, not one
group for all: NCCL runs a communicator's operations in order on one stream, so with
several targets and drafters a send to one drafter queued behind a send to another
could wait in a cycle; separate pairs progress independently.

The default group is created with a long timeout because loading a large target can
take minutes while other ranks wait at the first barrier; the working groups are created
after that barrier with `pipeline.timeout_s`, so a dead peer turns every blocked call
into an error within that time instead of a hang.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from dflash_train.pipeline.config import PipelineConfig
from dflash_train.pipeline.heartbeat import Heartbeat
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
    links: dict[tuple[int, int], object] = field(default_factory=dict)  # (target, drafter) -> group (split)
    link_device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # where link tensors live
    heartbeat: Heartbeat | None = None  # watches every other rank (distributed runs)
    target_group: object | None = None  # ranks sharing one sharded target (pipeline.target_group_size > 1)
    target_group_control: object | None = None  # the same ranks over gloo (split: per-batch agreement)
    target_group_ranks: list[int] = field(default_factory=list)

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


def one_of_several_processes() -> bool:
    """This process is one rank of a torchrun job of two or more."""
    return launched_by_torchrun() and int(os.environ["WORLD_SIZE"]) > 1


def resolve_layout(cfg: PipelineConfig) -> str:
    if cfg.layout != "auto":
        return cfg.layout
    return "colocated" if one_of_several_processes() else "single"


def init_distributed(cfg: PipelineConfig, device_name: str) -> DistContext:
    """Create the context for this process (and the process groups when distributed)."""
    layout = resolve_layout(cfg)
    if layout == "single":
        if one_of_several_processes():
            raise ConfigError("pipeline.layout=single under torchrun with several processes: use colocated or split")
        if cfg.target_group_size > 1:
            raise ConfigError(f"pipeline.target_group_size {cfg.target_group_size} shards the target over several "
                              f"processes: launch with torchrun (see docs/sharded-targets.md)")
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
    if len(targets) % cfg.target_group_size:
        raise ConfigError(f"pipeline.target_group_size {cfg.target_group_size} must divide the {len(targets)} "
                          f"target ranks")
    device = resolve_device(device_name, local)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    shared = gpus_shared_on_node([resolve_device(device_name, i) for i in range(local_world)], rank - local, drafters)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    # device_id binds this rank's GPU: NCCL communicators are created eagerly, here, not at
    # the first operation (which is where the split layout's first transfer deadlocked). Not
    # where ranks share a GPU: NCCL refuses a communicator with two ranks on one device, so the
    # world's would fail here; those ranks exchange over gloo (`_device_transport`).
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=cfg.startup_timeout_s),
                            device_id=device if device.type == "cuda" and not shared else None)
    working = timedelta(seconds=cfg.timeout_s)
    ctx = DistContext(layout=layout, rank=rank, world=world, local_rank=local, device=device,
                      target_ranks=targets, drafter_ranks=drafters)
    # from here on a dead peer is noticed even while this rank loads a model for minutes
    ctx.heartbeat = Heartbeat(rank, world, interval_s=cfg.heartbeat_s, dead_after_s=cfg.dead_rank_timeout_s).start()
    ctx.control = dist.new_group(backend="gloo", timeout=working)
    ctx.drafters = dist.new_group(drafters, backend="nccl" if device.type == "cuda" else "gloo", timeout=working)
    if cfg.target_group_size > 1:
        connect_target_groups(ctx, cfg.target_group_size, backend="nccl" if device.type == "cuda" else "gloo",
                              timeout=working)
    if layout == "split":
        on_device = _device_transport(cfg.transport, ctx)
        ctx.link_device = device if on_device else torch.device("cpu")
        ctx.links = connect_links(ctx, backend="nccl" if on_device else "gloo", timeout=working)
    return ctx


def gpus_shared_on_node(devices: list[torch.device], first_rank: int, drafter_ranks: list[int]) -> bool:
    """Whether ranks of this node share a GPU. `devices`: each local rank's device, in local
    rank order; `first_rank`: the global rank of local rank 0 (torchrun numbers a node's ranks
    consecutively). A target and a drafter may share one (the split layout's ranks then exchange
    over gloo); two drafters may not: NCCL, which all-reduces their gradients, refuses two ranks
    on one device, so that is a ConfigError naming the ranks and the way out."""
    ranks_on: dict[torch.device, list[int]] = {}
    for local, device in enumerate(devices):
        if device.type == "cuda":
            ranks_on.setdefault(device, []).append(first_rank + local)
    for device, ranks in ranks_on.items():
        drafters = [r for r in ranks if r in drafter_ranks]
        if len(drafters) > 1:
            raise ConfigError(
                f"drafter ranks {', '.join(map(str, drafters))} would share {device}: NCCL, which all-reduces the "
                f"drafters' gradients, refuses two ranks on one GPU. Launch one process per GPU (torchrun "
                f"--nproc-per-node {len(ranks_on)}), give the extra processes to targets (pipeline.layout split), "
                f"or train on the CPU (run.device cpu)")
    return any(len(ranks) > 1 for ranks in ranks_on.values())


def target_groups(target_ranks: list[int], size: int) -> list[list[int]]:
    """The target ranks in groups of `size` consecutive ranks, each holding one sharded target."""
    return [target_ranks[i:i + size] for i in range(0, len(target_ranks), size)]


def connect_target_groups(ctx: DistContext, size: int, *, backend: str, timeout: timedelta) -> None:
    """Create every target group (all ranks, in one order: torch requires it) and keep this rank's."""
    for ranks in target_groups(ctx.target_ranks, size):
        group = dist.new_group(ranks, backend=backend, timeout=timeout)
        control = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if ctx.rank in ranks:
            ctx.target_group, ctx.target_group_control, ctx.target_group_ranks = group, control, ranks


def link_pairs(ctx: DistContext) -> list[tuple[int, int]]:
    """The (target rank, drafter rank) pairs that exchange hidden states, in one global order."""
    T, D = ctx.num_targets, ctx.num_drafters
    return sorted({(ctx.target_of(g), ctx.drafter_of(g)) for g in range(T * D)})


def connect_links(ctx: DistContext, *, backend: str, timeout: timedelta) -> dict[tuple[int, int], object]:
    """One group per pair, created by every rank (torch requires it) and connected by one
    batched exchange of its two members, all in the order of `link_pairs`."""
    links = {}
    for pair in link_pairs(ctx):
        group = dist.new_group(list(pair), backend=backend, timeout=timeout)
        if ctx.rank in pair:
            links[pair] = group
    for pair, group in sorted(links.items()):
        peer = pair[1] if ctx.rank == pair[0] else pair[0]
        mine = torch.full((1,), ctx.rank, dtype=torch.long, device=ctx.link_device)
        theirs = torch.full((1,), -1, dtype=torch.long, device=ctx.link_device)
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, group),
                                            dist.P2POp(dist.irecv, theirs, peer, group)]):
            work.wait()
        if int(theirs.item()) != peer:  # .item() also waits for the GPU
            raise RuntimeError(f"link {pair}: connected to rank {int(theirs.item())}, expected {peer}")
    return links


def _device_transport(transport: str, ctx: DistContext) -> bool:
    """Whether hidden states go GPU to GPU over NCCL (`pipeline.transport`): `host` never,
    `device` always (an error where NCCL cannot: CPU ranks, two ranks on one GPU), `auto`
    whenever it can (every rank on its own GPU)."""
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
    if ctx.heartbeat is not None:
        ctx.heartbeat.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def exit_finished_rank() -> NoReturn:
    """End a rank of a torchrun job whose work is done, written and shut down (`shutdown`),
    with exit code 0 and without the interpreter's finalisation. torch.distributed's C++
    threads can still be releasing what a collective held when finalisation begins, and one
    that then needs the GIL aborts the process (SIGABRT, "terminate called without an active
    exception", no Python thread left to show): a failed job after a complete run. Seen
    rarely on a loaded machine, after the last line of the summary. Output is flushed first;
    nothing of this project runs at interpreter exit."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
