"""Where a drafter's (batch, target output) pairs come from.

* `LocalTargetSource`: single process and colocated layout; the trainer runs the
  target itself on each batch.
* `RemoteTargetSource`: split layout; the target ran on a target rank and the hidden
  states arrive through `HiddenStateReceiver`, requested `queue_depth` batches ahead.
"""

from __future__ import annotations

import time
from collections import deque

import torch
import torch.distributed as dist

from dflash_train.drafter.loss import StepStats
from dflash_train.pipeline.transport import HiddenStateReceiver


class LocalTargetSource:
    stop_requested = False

    def __init__(self, loader):
        self.loader = loader

    def next(self, timer):
        return next(self.loader), None, False

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        self.loader.close()


class RemoteTargetSource:
    def __init__(self, loader, ctx, *, taps_width, hidden, need_final, dtype, queue_depth, budget, prepare):
        self.loader, self.ctx = loader, ctx
        self.receiver = HiddenStateReceiver(ctx, taps_width=taps_width, hidden=hidden, need_final=need_final,
                                            dtype=dtype, queue_depth=queue_depth)
        self.prepare = prepare
        self.budget = budget  # batches this drafter will still train on: never credit more
        # Transport sequence: this drafter's q-th batch from here on is g = q * D + d of the
        # global order, counted across epochs the same way the target ranks count it.
        self.requested = 0
        self._last_handoff: float | None = None
        self.ahead: deque = deque()
        for _ in range(queue_depth):
            self._request_one()

    @property
    def stop_requested(self) -> bool:
        return self.receiver.stop_requested

    def _request_one(self) -> None:
        if self.budget <= 0:
            return
        try:
            batch = next(self.loader)
        except StopIteration:
            self.budget = 0
            return
        self.budget -= 1
        R, S = self.prepare(batch).input_ids.shape
        g = self.requested * self.ctx.num_drafters + self.ctx.drafter_index
        self.requested += 1
        self.receiver.request(g, R, S)
        self.ahead.append((g, batch, R, S))

    def next(self, timer):
        if not self.ahead:
            raise StopIteration
        g, batch, R, S = self.ahead.popleft()  # shape noted at request time: no second padding copy
        t_wait_start = time.perf_counter()
        t = timer.start()
        out = self.receiver.get(g, R, S)
        timer.stop("queue_wait", t)
        poisoned = self.receiver.stop_requested
        self._request_one()
        now = time.perf_counter()
        if self._last_handoff is not None:  # the drafter's work on the previous batch
            self.receiver.stats.busy_ms.append((t_wait_start - self._last_handoff) * 1000)
        self._last_handoff = now
        return batch, out, poisoned

    def stats(self) -> dict:
        return self.receiver.stats.as_dict()

    def close(self) -> None:
        self.receiver.finish()
        self.loader.close()


def reduce_stats(window: list[StepStats], group) -> list[StepStats]:
    """Sum a window of step statistics over the drafter replicas (one all-reduce)."""
    fields = ("loss_sum", "weight_sum", "ce_sum", "tau_sum", "blocks")
    scalars = torch.stack([torch.stack([getattr(s, f).detach().float().reshape(()) for f in fields]) for s in window]).sum(0)
    correct = torch.stack([s.correct for s in window]).sum(0).float()
    counted = torch.stack([s.counted for s in window]).sum(0).float()
    flat = torch.cat([scalars, correct, counted])
    dist.all_reduce(flat, group=group)
    n = len(correct)
    return [StepStats(loss_sum=flat[0], weight_sum=flat[1], ce_sum=flat[2], tau_sum=flat[3], blocks=flat[4],
                      correct=flat[5:5 + n], counted=flat[5 + n:])]
