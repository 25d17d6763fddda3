"""A split layout's target rank whose target is sharded over a group (pipeline.target_group_size G > 1).

Each rank of a group still produces its own batches (the same global order as unsharded
targets: batch g from target g % T), but a forward of the sharded target is a collective
of the whole group: each layer's weights are all-gathered from the G ranks (FSDP2,
target/sharded.py). So the group runs in rounds: in round k target t handles batch
g = t + k T, and before the forward the group agrees, in one all-reduce of two flags on its
gloo group, whether anyone has a batch this round and whether anyone was asked to stop.
A rank without a batch (its drafter ended, or the plan has none left for it) runs the same
forward on one token so the others' all-gathers complete; a stop is the group's, so every rank of it
sends placeholders in the same round and none is left inside a forward alone.

Deadlock freedom: a rank waits for its drafter's credit before the agreement, so a round
waits for the credits of all its members. A drafter credits batch q + queue_depth when it
receives batch q; with queue_depth x drafter_ranks >= G (checked by PipelineConfig) the
batches a round's credits wait for all come from earlier rounds (docs/sharded-targets.md).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dflash_train.pipeline.target_worker import TargetWorker
from dflash_train.target.runner import TargetRunner


def agree(group, has_batch: bool, stop: bool) -> tuple[bool, bool]:
    """(does any rank of the group have a batch this round, did any rank get a stop signal)."""
    flags = torch.tensor([int(has_batch), int(stop)], dtype=torch.long)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return bool(flags[0]), bool(flags[1])


def idle_forward(runner: TargetRunner, device: torch.device, padding: tuple[int, int] | None) -> None:
    """This rank's part of the all-gathers of a round it has no batch in: the forward its peers run
    (the Hugging Face or the packed one, the same layers) on one token, in the batches' compiled
    shape when they are padded to one (`padding`), so that no new shape is compiled."""
    rows, length = padding or (1, 1)
    ids = torch.zeros(rows, length, dtype=torch.long, device=device)
    documents = torch.full_like(ids, -1)
    documents[0, 0] = 0  # one real token; the rest is padding
    runner(ids, torch.zeros_like(ids), documents, one_document_rows=True)


class GroupTargetWorker(TargetWorker):
    """TargetWorker for a rank of a target group: the same batches, in rounds agreed with the group."""

    def run(self) -> dict:
        ctx, loop = self.ctx, self._loop()
        T, D = ctx.num_targets, ctx.num_drafters
        with self._signals() as signals:
            for k in range(math.ceil(loop.total / T)):  # the same rounds on every rank of the group
                g = ctx.target_index + k * T
                job = None
                if g < loop.total and not loop.ended >= loop.mine:
                    q, d = divmod(g, D)
                    drafter_rank = ctx.drafter_ranks[d]
                    if drafter_rank in loop.ended or not loop.sender.wait_credit(drafter_rank, g):
                        loop.ended.add(drafter_rank)
                    else:
                        job = (q, d)
                anyone, stop = agree(ctx.target_group_control, job is not None, signals.received is not None)
                if job is None:
                    if anyone and not stop:
                        idle_forward(self.runner, ctx.device, self.padding)
                    continue
                self._serve(loop, g, *job, stop=stop)  # a stop is the group's: placeholders in the same round
            return self._finish(loop, signals)
