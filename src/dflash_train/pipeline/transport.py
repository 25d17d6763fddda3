"""Hidden states from target ranks to drafter ranks, with bounded queues (split layout).

Batch g of the global order (g = q * D + d for the q-th batch of drafter d) is produced
by target `g % T` and consumed by drafter `d`. Flow control is credit based, per
(drafter, target) pair, on the gloo `control` group:

    drafter: send CONTINUE(g) to its target -> post the receives for batch g
    target:  receive the credit for its next g -> run the target -> send header + tensors

A drafter credits at most `queue_depth` batches beyond the one it is training on, so a
drafter never holds more than `queue_depth` batches (bounded memory) and a target that
runs ahead blocks on its next credit (backpressure). At the end, a drafter sends END
to each of its targets and receives every batch it had credited, so no transfer is ever
left half-matched.

The header (status, g, R, S) travels on the control group; the tensors on the pair's own
link group (pipeline/context.py: created and connected at start-up), in one batched
isend/irecv per batch: NCCL GPU to GPU (`device` transport), or gloo through pinned host
memory (`host`: CPU runs, and a target and a drafter sharing one GPU, which NCCL refuses).
Both paths run this same code; only the group's backend and the buffers' device differ,
so the CPU tests exercise the ordering the GPUs use. Nothing here blocks on the control
group while a transfer is half set up: the credit goes out before the drafter posts its
receives, and the target blocks only on a credit, never on a tensor. A target asked to
stop sends STOP_REQUEST headers; the drafters then agree on a stop step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dflash_train.pipeline.context import DistContext
from dflash_train.target.runner import TargetOutput

CONTINUE, END = 1, 0
OK, STOP_REQUEST = 1, 2


@dataclass
class WaitStats:
    """Time blocked on the queue, and how full it was when looked at."""

    wait_s: float = 0.0
    waits: int = 0
    fill_sum: float = 0.0
    fill_samples: int = 0
    transfer_s: float = 0.0
    items: int = 0
    bytes: int = 0
    busy_ms: list[float] = field(default_factory=list)  # per batch: work time, queue waits excluded

    def as_dict(self) -> dict:
        busy = sorted(self.busy_ms)
        return {"queue_wait_s": self.wait_s, "queue_waits": self.waits, "transfer_s": self.transfer_s,
                "batches": self.items, "bytes": self.bytes,
                "median_busy_ms_per_batch": busy[len(busy) // 2] if busy else 0.0,
                "mean_queue_fill": self.fill_sum / self.fill_samples if self.fill_samples else 0.0}


def _link(ctx: DistContext, target: int, drafter: int):
    try:
        return ctx.links[(target, drafter)]
    except KeyError:
        raise RuntimeError(f"no link between target rank {target} and drafter rank {drafter}") from None


def _batched(op, tensors: list[torch.Tensor], peer: int, group) -> list[object]:
    """All of a batch's tensors in one batched call (one NCCL group launch on GPU)."""
    return dist.batch_isend_irecv([dist.P2POp(op, x, peer, group) for x in tensors])


def tensor_shapes(R: int, S: int, taps_width: int, hidden: int, need_final: bool) -> list[tuple[int, ...]]:
    shapes = [(R, S, taps_width)]
    if need_final:
        shapes.append((R, S, hidden))
    return shapes


def drafter_targets(ctx: DistContext, d: int) -> list[int]:
    """Target ranks that ever produce for drafter index d."""
    D = ctx.num_drafters
    return sorted({ctx.target_of(q * D + d) for q in range(ctx.num_targets)})


@dataclass
class _Pending:
    g: int
    src: int
    header: torch.Tensor
    header_work: object
    buffers: list[torch.Tensor]
    works: list[object] = field(default_factory=list)


class HiddenStateReceiver:
    """Drafter side: credits, prefetched receives, waiting statistics."""

    def __init__(self, ctx: DistContext, *, taps_width: int, hidden: int, need_final: bool, dtype: torch.dtype,
                 queue_depth: int):
        self.ctx, self.taps_width, self.hidden, self.need_final = ctx, taps_width, hidden, need_final
        self.dtype, self.depth = dtype, queue_depth
        self.pending: deque[_Pending] = deque()
        self.stats = WaitStats()
        self.stop_requested = False
        self.ended = False
        self._credits: deque = deque()  # credit sends in flight (their tensors stay referenced)

    def request(self, g: int, R: int, S: int) -> None:
        """Credit batch g of shape [R, S] to its target, then post the receives for it."""
        ctx = self.ctx
        src = ctx.target_of(g)
        device = ctx.link_device
        pin = device.type == "cpu" and ctx.device.type == "cuda"
        # Credit first, non-blocking: the target may start at once, and nothing between
        # here and the posted receives can block (a blocking send would also wait for the
        # target to finish its current batch, stalling this drafter for nothing).
        self._credits.append(dist.isend(torch.tensor([CONTINUE, g], dtype=torch.long), dst=src, group=ctx.control))
        header = torch.zeros(4, dtype=torch.long)
        hw = dist.irecv(header, src=src, group=ctx.control)
        buffers = [torch.empty(s, dtype=self.dtype, device=device, pin_memory=pin)
                   for s in tensor_shapes(R, S, self.taps_width, self.hidden, self.need_final)]
        works = _batched(dist.irecv, buffers, src, _link(ctx, src, ctx.rank))
        while len(self._credits) > 2 * self.depth:
            self._credits.popleft().wait()
        self.pending.append(_Pending(g, src, header, hw, buffers, works))

    def get(self, g: int, R: int, S: int) -> TargetOutput:
        """The target output of batch g (which must be the oldest requested)."""
        item = self.pending.popleft()
        if item.g != g:
            raise RuntimeError(f"transport out of order: expected batch {g}, the queue holds {item.g}")
        self.stats.fill_sum += sum(1 for p in [item, *self.pending] if p.header_work.is_completed())
        self.stats.fill_samples += 1
        t = time.perf_counter()
        blocked = not item.header_work.is_completed()
        item.header_work.wait()
        for w in item.works:
            w.wait()
        waited = time.perf_counter() - t
        if blocked:
            self.stats.waits += 1
        self.stats.wait_s += waited
        status, hg, hR, hS = item.header.tolist()
        if hg != g or (hR, hS) != (R, S):
            raise RuntimeError(f"target rank {item.src} sent batch {hg} [{hR}, {hS}] where batch {g} [{R}, {S}] "
                               f"was expected: targets and drafters disagree on the data plan")
        if status == STOP_REQUEST:
            self.stop_requested = True
        t = time.perf_counter()
        tensors = [b.to(self.ctx.device, non_blocking=True) for b in item.buffers]
        self.stats.transfer_s += time.perf_counter() - t
        self.stats.items += 1
        self.stats.bytes += sum(b.numel() * b.element_size() for b in item.buffers)
        return TargetOutput(tensors[0], tensors[1] if self.need_final else None)

    def finish(self) -> None:
        """Send END to every target of this drafter, then receive what was credited."""
        if self.ended:
            return
        self.ended = True
        for t in drafter_targets(self.ctx, self.ctx.drafter_index):
            self._credits.append(dist.isend(torch.tensor([END, -1], dtype=torch.long), dst=t, group=self.ctx.control))
        while self._credits:
            self._credits.popleft().wait()
        while self.pending:
            item = self.pending.popleft()
            item.header_work.wait()
            for w in item.works:
                w.wait()


class HiddenStateSender:
    """Target side: waits for credits, sends headers and tensors; counts the waits."""

    def __init__(self, ctx: DistContext, queue_depth: int):
        self.ctx, self.depth = ctx, queue_depth
        self.in_flight: deque[tuple[list[object], list[torch.Tensor]]] = deque()
        self.stats = WaitStats()

    def wait_credit(self, drafter_rank: int, g: int) -> bool:
        """Block until drafter `drafter_rank` credits batch g; False once it sent END."""
        msg = torch.zeros(2, dtype=torch.long)
        t = time.perf_counter()
        dist.recv(msg, src=drafter_rank, group=self.ctx.control)
        waited = time.perf_counter() - t
        self.stats.wait_s += waited
        self.stats.waits += int(waited > 1e-3)
        kind, credited = msg.tolist()
        if kind == END:
            return False
        if credited != g:
            raise RuntimeError(f"drafter rank {drafter_rank} credited batch {credited}, target expected {g}")
        return True

    def send(self, drafter_rank: int, g: int, tensors: list[torch.Tensor], *, stop_request: bool) -> None:
        ctx = self.ctx
        R, S = tensors[0].shape[:2]
        dist.send(torch.tensor([STOP_REQUEST if stop_request else OK, g, R, S], dtype=torch.long),
                  dst=drafter_rank, group=ctx.control)
        t = time.perf_counter()
        # host path: a synchronous device->host copy; device path: the tensors as they are
        out = [x.to(ctx.link_device).contiguous() for x in tensors]
        works = _batched(dist.isend, out, drafter_rank, _link(ctx, ctx.rank, drafter_rank))
        self.in_flight.append((works, out))  # keep the buffers alive until sent
        while len(self.in_flight) > self.depth:
            for w in self.in_flight.popleft()[0]:
                w.wait()
        self.stats.transfer_s += time.perf_counter() - t
        self.stats.items += 1
        self.stats.bytes += sum(x.numel() * x.element_size() for x in tensors)

    def flush(self) -> None:
        while self.in_flight:
            for w in self.in_flight.popleft()[0]:
                w.wait()
