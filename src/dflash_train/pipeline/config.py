"""`pipeline:` section of the training config: how ranks are laid out.

    single     one process: target and drafter on one device (no torch.distributed)
    colocated  every rank runs a target and a drafter; drafters are data-parallel
    split      `target_ranks` ranks run only targets, `drafter_ranks` only drafters; targets
               send each batch's tapped hidden states to a fixed drafter over
               torch.distributed point-to-point, at most `queue_depth` batches in flight
               per drafter

`layout: auto` means single without torchrun and colocated under torchrun.

`target_group_size` G > 1 shards the frozen target over groups of G consecutive target ranks
(FSDP2, target/sharded.py; docs/sharded-targets.md): each rank holds 1/G of its parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LAYOUTS = ("auto", "single", "colocated", "split")
TRANSPORTS = ("auto", "device", "host")


@dataclass
class PipelineConfig:
    layout: Literal["auto", "single", "colocated", "split"] = "auto"
    """how ranks are laid out (see above)"""
    target_ranks: int = 0
    """split: how many of the world's ranks run targets"""
    drafter_ranks: int = 0
    """split: how many run drafters (target_ranks + drafter_ranks = world size)"""
    queue_depth: int = 4
    """batches in flight per drafter (>= optim.grad_accum)"""
    overlap_target: bool = False
    """single/colocated: run the next batch's target forward (on a second CUDA stream) during this
    batch's drafter step; holds one more batch of target outputs in memory"""
    transport: Literal["auto", "device", "host"] = "auto"
    """device: hidden states GPU to GPU over NCCL (ranks on distinct GPUs); host: through pinned
    host memory over gloo (always works; needed when a target and a drafter share one GPU,
    which NCCL refuses); auto picks per pair"""
    timeout_s: float = 600.0
    """a blocked collective or transfer fails after this long. It must exceed the longest wait a
    live peer may cause: its first step's compilation (a CPU drafter step of the bench shape took
    over 60 s and ended a split run with a gloo timeout), a target's compiled forward, a
    checkpoint save. Dead or frozen processes are found sooner by the heartbeat
    (dead_rank_timeout_s); this only ends a live rank stuck in a call that never returns"""
    startup_timeout_s: float = 1800.0
    """model loading may take long: the first barrier waits this long"""
    target_group_size: int = 1
    """ranks that hold one copy of the target between them, each 1/G of its weights (FSDP2; for targets
    larger than one GPU): groups of this many consecutive target ranks (colocated: all ranks; split: the
    target ranks). 1 = every target rank loads the whole target"""
    heartbeat_s: float = 1.0
    """every rank bumps a counter in the job's store this often (pipeline/heartbeat.py)"""
    dead_rank_timeout_s: float = 20.0
    """a rank whose heartbeat stops this long is dead: the others exit (code 3) naming it. Below
    torchrun's 30 s shutdown grace, so survivors end themselves and say why"""

    def __post_init__(self) -> None:
        if self.queue_depth < 1:
            raise ValueError("pipeline.queue_depth must be >= 1")
        if self.target_ranks < 0 or self.drafter_ranks < 0:
            raise ValueError("pipeline.target_ranks and pipeline.drafter_ranks must be >= 0")
        if self.layout == "split" and (self.target_ranks < 1 or self.drafter_ranks < 1):
            raise ValueError("pipeline.layout=split needs pipeline.target_ranks >= 1 and pipeline.drafter_ranks >= 1")
        if self.layout == "split" and self.overlap_target:
            raise ValueError("pipeline.overlap_target is for the single and colocated layouts (a split layout's "
                             "target ranks already run ahead of the drafters)")
        if self.target_group_size < 1:
            raise ValueError("pipeline.target_group_size must be >= 1")
        if self.target_group_size > 1:
            self._check_target_groups()
        if self.timeout_s <= 0 or self.startup_timeout_s <= 0:
            raise ValueError("pipeline timeouts must be positive")
        if self.heartbeat_s <= 0 or self.dead_rank_timeout_s < 3 * self.heartbeat_s:
            raise ValueError("pipeline.heartbeat_s must be positive and pipeline.dead_rank_timeout_s at least "
                             "3 heartbeats")

    def _check_target_groups(self) -> None:
        G = self.target_group_size
        if self.layout == "single":
            raise ValueError(f"pipeline.target_group_size {G} shards the target over {G} processes: launch with "
                             f"torchrun (layout colocated or split), not layout single")
        if self.overlap_target:
            raise ValueError("pipeline.overlap_target runs the target on a second CUDA stream, which a sharded "
                             "target (pipeline.target_group_size > 1) does not: leave it off")
        if self.layout == "split" and self.target_ranks % G:
            raise ValueError(f"pipeline.target_ranks ({self.target_ranks}) must be a multiple of "
                             f"pipeline.target_group_size ({G})")
        # the G ranks of a group run their forwards together, each after its own drafter's credit: a
        # drafter credits `queue_depth` batches ahead, and with queue_depth x drafter_ranks >= G every
        # credit a group waits for depends only on batches of earlier rounds (docs/sharded-targets.md)
        if self.layout == "split" and self.queue_depth * self.drafter_ranks < G:
            raise ValueError(f"pipeline.queue_depth ({self.queue_depth}) x pipeline.drafter_ranks "
                             f"({self.drafter_ranks}) must be >= pipeline.target_group_size ({G}): raise "
                             f"queue_depth")
