"""Where a drafter's (batch, target output) pairs come from.

* `LocalTargetSource`: single process and colocated layout; the target runs in this
  process on each batch. With `pipeline.overlap_target` it runs one batch ahead: batch
  k + 1's target forward is launched (on a second CUDA stream on a GPU) before batch k is
  handed out, so it overlaps batch k's drafter step; one more batch of taps is held.
* `RemoteTargetSource`: split layout; the target ran on a target rank and the hidden
  states arrive through `HiddenStateReceiver`, requested `queue_depth` batches ahead.

Both are a `BatchSource`: they hand out batches as the loader prepared them (padded to
the compiled shape, or as they are; pinned on a GPU), still on the CPU, with the target
output on the device. `next` raises StopIteration at the end of the data; it also returns
whether the batch is a stop-request placeholder.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from dflash_train.data.batch import PackedBatch
from dflash_train.drafter.loss import StepStats
from dflash_train.pipeline.transport import HiddenStateReceiver
from dflash_train.target.runner import TargetOutput, TargetRunner


class StageClock(Protocol):
    """Where a source books its time (train/timing.py StageTimer): device spans, host seconds."""

    def start(self) -> object: ...

    def stop(self, name: str, begin: object) -> None: ...

    def add_host(self, name: str, seconds: float) -> None: ...


class SourcedBatch(NamedTuple):
    """One micro-batch as a source hands it out."""

    batch: PackedBatch  # on the CPU, as the loader prepared it
    target: TargetOutput  # the target's output on it, on the drafter's device
    placeholder: bool  # a stop-request placeholder from a stopping target: redo after resume


class BatchSource(Protocol):
    """What the trainer pulls its micro-batches from."""

    @property
    def stop_requested(self) -> bool:
        """A target rank asked the drafters to stop."""

    def next(self, timer: StageClock) -> SourcedBatch:
        """The next micro-batch; StopIteration at the end of the data."""

    def stats(self) -> dict:
        """The transport's numbers for the run's summary ({} when the target runs here)."""

    def close(self) -> None: ...


class LocalTargetSource:
    stop_requested = False

    def __init__(self, loader, runner: TargetRunner, device: torch.device, *, overlap: bool = False):
        self.loader, self.runner, self.device = loader, runner, device
        self.overlap = overlap
        # The hardware difference: on a GPU the look-ahead runs on a stream of its own; on a
        # CPU it is the same order of work, done synchronously.
        self.stream = torch.cuda.Stream(device) if overlap and device.type == "cuda" else None
        self._ahead: tuple | None = None  # (batch, target output, done event) of the next batch
        self._end: BaseException | None = None  # what the loader raised while reading ahead

    def _run(self, timer: StageClock) -> tuple[PackedBatch, TargetOutput, object]:
        """Read one batch and launch its target forward (on the side stream when overlapping)."""
        t = time.perf_counter()
        batch = next(self.loader)
        timer.add_host("data", time.perf_counter() - t)
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            t = timer.start()  # events on the side stream: the span of the target forward there
            out = self.runner.run_batch(batch, self.device)
            timer.stop("target", t)
            done = None
            if self.stream is not None:
                done = torch.cuda.Event()
                done.record(self.stream)
        return batch, out, done

    def next(self, timer: StageClock) -> SourcedBatch:
        if not self.overlap:
            batch, out, _ = self._run(timer)
            return SourcedBatch(batch, out, False)
        if self._ahead is None:
            if self._end is not None:
                raise self._end
            self._ahead = self._run(timer)
        batch, out, done = self._ahead
        self._ahead = None
        try:  # the next batch's forward goes in before this batch's drafter step
            self._ahead = self._run(timer)
        except Exception as exc:  # noqa: BLE001 -- StopIteration or a data error: raised at the next call, its place
            self._end = exc
        if done is not None:
            main = torch.cuda.current_stream(self.device)
            t = timer.start()
            main.wait_event(done)
            timer.stop("target_wait", t)
            for tensor in (out.taps, out.final_hidden):
                if tensor is not None:  # made on the side stream, read (and freed) on this one
                    tensor.record_stream(main)
        return SourcedBatch(batch, out, False)

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
        self._ahead = None
        self.loader.close()


class RemoteTargetSource:
    def __init__(self, loader, ctx, *, taps_width, hidden, need_final, dtype, queue_depth, budget):
        self.loader, self.ctx = loader, ctx
        self.receiver = HiddenStateReceiver(ctx, taps_width=taps_width, hidden=hidden, need_final=need_final,
                                            dtype=dtype, queue_depth=queue_depth)
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
        R, S = batch.input_ids.shape
        g = self.requested * self.ctx.num_drafters + self.ctx.drafter_index
        self.requested += 1
        self.receiver.request(g, R, S)
        self.ahead.append((g, batch, R, S))

    def next(self, timer: StageClock) -> SourcedBatch:
        if not self.ahead:
            raise StopIteration
        g, batch, R, S = self.ahead.popleft()
        t_wait_start = time.perf_counter()
        t = timer.start()
        out = self.receiver.get(g, R, S)
        timer.stop("queue_wait", t)
        poisoned = self.receiver.stop_requested
        t = time.perf_counter()
        self._request_one()
        now = time.perf_counter()
        timer.add_host("data", now - t)
        if self._last_handoff is not None:  # the drafter's work on the previous batch
            self.receiver.stats.busy_ms.append((t_wait_start - self._last_handoff) * 1000)
        self._last_handoff = now
        return SourcedBatch(batch, out, poisoned)

    def stats(self) -> dict:
        return self.receiver.stats.as_dict()

    def close(self) -> None:
        self.receiver.finish()
        self.loader.close()


def reduce_stats(window: list[StepStats], group) -> list[StepStats]:
    """Sum a window of step statistics over the drafter replicas (one all-reduce)."""
    flat = torch.stack([s.flat(torch.float32) for s in window]).sum(0)
    dist.all_reduce(flat, group=group)
    return [StepStats.from_flat(flat)]
