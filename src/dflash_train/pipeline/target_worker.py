"""A target rank of the split layout: read its batches, run the frozen target, send.

The rank walks the global batch order g = t, t + T, t + 2T, ... (t its target index).
Batch g is the q-th batch (q = g // D) of drafter d = g % D's share of the plan; the
target rebuilds it from the same planner and dataset the drafter reads, so only hidden
states cross the network, never token data.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from dflash_train.data.batching import build_batch
from dflash_train.data.splits import DataSplits
from dflash_train.pipeline.context import DistContext
from dflash_train.pipeline.transport import HiddenStateSender
from dflash_train.target.runner import TargetRunner
from dflash_train.utils.signals import StopSignals


def broadcast_start(ctx: DistContext, **start) -> dict:
    """Main drafter -> every rank: where the data cursor starts and how many batches each
    drafter will take. Runs on the default group, whose timeout covers model loading."""
    box = [start if ctx.is_main_drafter else None]
    dist.broadcast_object_list(box, src=ctx.drafter_ranks[0], device=torch.device("cpu"))
    return box[0]


def drafter_positions(planner, start_epoch: int, start_index: int, world: int):
    """(epoch, index) of a drafter's q-th batch, q = 0, 1, ... (all drafters' shares are equal)."""
    epoch, index = start_epoch, start_index
    while True:
        n = len(planner.shard(epoch, 0, world))
        while index < n:
            yield epoch, index
            index += 1
        epoch, index = epoch + 1, 0


class TargetWorker:
    """Runs the frozen target on its share of the global batch order and sends the taps on.

    Built by the training job (train/run.py) from the same data splits and runner a
    colocated rank would use; `start` is the main drafter's broadcast (cursor, budget)."""

    def __init__(self, ctx: DistContext, runner: TargetRunner, data: DataSplits, *, queue_depth: int,
                 padding: tuple[int, int] | None, load_s: float = 0.0, signals: StopSignals | None = None):
        self.ctx, self.runner, self.data, self.signals = ctx, runner, data, signals
        self.queue_depth, self.padding, self.load_s = queue_depth, padding, load_s
        self.start = broadcast_start(ctx)

    def run(self) -> dict:
        ctx, loop = self.ctx, self._loop()
        T = ctx.num_targets
        with self._signals() as signals:
            for g in range(ctx.target_index, loop.total, T):
                if loop.ended >= loop.mine:
                    break
                q, d = divmod(g, ctx.num_drafters)
                drafter_rank = ctx.drafter_ranks[d]
                if drafter_rank in loop.ended or not loop.sender.wait_credit(drafter_rank, g):
                    loop.ended.add(drafter_rank)
                    continue
                self._serve(loop, g, q, d, stop=signals.received is not None)
            return self._finish(loop, signals)

    # -- what every target rank's loop shares (the group worker's too: pipeline/target_group.py) --

    def _loop(self) -> "_Loop":
        ctx, D = self.ctx, self.ctx.num_drafters
        positions = drafter_positions(self.data.planner, self.start["epoch"], self.start["index"], D)
        mine = {ctx.drafter_of(g) for g in range(ctx.target_index, ctx.target_index + ctx.num_targets * D,
                                                 ctx.num_targets)}
        return _Loop(total=self.start["batches"] * D,  # global batches the drafters will take
                     sender=HiddenStateSender(ctx, self.queue_depth), positions=positions, mine=mine)

    def _signals(self):
        """The job's recorder (installed for the process's whole life), else one for this loop."""
        return contextlib.nullcontext(self.signals) if self.signals else StopSignals(second_ctrl_c_aborts=False)

    def _serve(self, loop: "_Loop", g: int, q: int, d: int, *, stop: bool) -> None:
        """Build batch g (drafter d's q-th), run the target (placeholders when stopping: the
        drafters discard that step and stop) and send the result to drafter d."""
        ctx = self.ctx
        while len(loop.pos_of_q) <= q:
            loop.pos_of_q.append(next(loop.positions))
        epoch, index = loop.pos_of_q[q]
        batch = build_batch(self.data.train, self.data.planner.shard(epoch, d, ctx.num_drafters)[index],
                            epoch=epoch, index=index)
        if self.padding is not None:
            batch = batch.pad_to(*self.padding)
        c0 = time.perf_counter()
        if not stop:
            out = self.runner.run_batch(batch, ctx.device)
            tensors = [out.taps] + ([out.final_hidden] if out.final_hidden is not None else [])
            loop.tokens += batch.num_tokens
        else:
            tensors = placeholders(self.runner, *batch.input_ids.shape, ctx.device)
        if ctx.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # honest compute time (once per batch)
        loop.compute_s += time.perf_counter() - c0
        loop.sender.stats.busy_ms.append((time.perf_counter() - c0) * 1000)
        loop.sender.send(ctx.drafter_ranks[d], g, tensors, stop_request=stop)

    def _finish(self, loop: "_Loop", signals: StopSignals) -> dict:
        for drafter_rank in sorted(loop.mine - loop.ended):  # every drafter ends its stream with END
            if loop.sender.wait_credit(drafter_rank, -1):
                raise RuntimeError(f"drafter rank {drafter_rank} credited a batch past the end of the plan")
        loop.sender.flush()
        wall = time.perf_counter() - loop.wall0
        return {"role": "target", "rank": self.ctx.rank, "batches": loop.sender.stats.items, "tokens": loop.tokens,
                "compute_s": loop.compute_s, "wall_s": wall, "load_s": self.load_s,
                "tok_per_s": loop.tokens / max(wall, 1e-9), **loop.sender.stats.as_dict(),
                "stop_signal": signals.received}


@dataclass
class _Loop:
    """A target rank's progress through its share of the global batch order."""

    total: int
    sender: HiddenStateSender
    positions: Iterator[tuple[int, int]]  # (epoch, index) of a drafter's q-th batch, q = 0, 1, ...
    mine: set[int]  # the drafter ranks this target rank feeds
    pos_of_q: list[tuple[int, int]] = field(default_factory=list)
    ended: set[int] = field(default_factory=set)
    tokens: int = 0
    compute_s: float = 0.0
    wall0: float = field(default_factory=time.perf_counter)


def placeholders(runner: TargetRunner, R: int, S: int, device: torch.device) -> list[torch.Tensor]:
    """Zeros of the shapes of a batch's target output (stop requests: the drafters discard the step)."""
    width = len(runner.layer_ids) * runner.hidden_size
    dtype = next(runner.model.parameters()).dtype
    out = [torch.zeros(R, S, width, dtype=dtype, device=device)]
    if runner.need_final:
        out.append(torch.zeros(R, S, runner.hidden_size, dtype=dtype, device=device))
    return out
