"""Step statistics summed over the drafter replicas: every field, every slot, in its place."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_train.drafter.loss import StepStats
from dflash_train.pipeline.sources import reduce_stats

WORLD, WINDOW, SLOTS = 2, 3, 4
SCALARS = ("loss_sum", "weight_sum", "ce_sum", "tau_sum", "blocks")
PER_SLOT = ("correct", "counted", "reached")


def window_of(rank: int) -> list[StepStats]:
    """Distinct values in every field of every step (integers: sums stay exact in float32)."""
    g = torch.Generator().manual_seed(rank)
    return [StepStats(**{f: torch.randint(1, 1000, (), generator=g).float() for f in SCALARS},
                      **{f: torch.randint(0, 1000, (SLOTS,), generator=g) for f in PER_SLOT})
            for _ in range(WINDOW)]


def replica(rank: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        (reduced,) = reduce_stats(window_of(rank), dist.group.WORLD)
        torch.save({f: getattr(reduced, f) for f in SCALARS + PER_SLOT}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_replicas_sum_every_field_of_their_windows(tmp_path):
    mp.spawn(replica, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD)
    steps = [s for rank in range(WORLD) for s in window_of(rank)]
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for f in SCALARS + PER_SLOT:
            want = torch.stack([getattr(s, f).float() for s in steps]).sum(0)
            assert torch.equal(got[f], want), f
