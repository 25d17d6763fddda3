"""A target rank of the split layout: read its batches, run the frozen target, send.

The rank walks the global batch order g = t, t + T, t + 2T, ... (t its target index).
Batch g is the q-th batch (q = g // D) of drafter d = g % D's share of the plan; the
target rebuilds it from the same planner and dataset the drafter reads, so only hidden
states cross the network, never token data.
"""

from __future__ import annotations

import contextlib
import time

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
        ctx = self.ctx
        T, D, t = ctx.num_targets, ctx.num_drafters, ctx.target_index
        total = self.start["batches"] * D  # global batches the drafters will take
        sender = HiddenStateSender(ctx, self.queue_depth)
        plan = self.data.planner
        positions = drafter_positions(plan, self.start["epoch"], self.start["index"], D)
        pos_of_q: list[tuple[int, int]] = []
        ended: set[int] = set()
        mine = {ctx.drafter_of(g) for g in range(t, t + T * D, T)}
        compute_s, tokens, wall0 = 0.0, 0, time.perf_counter()
        # the job's recorder (installed for the process's whole life), else one for this loop
        with contextlib.nullcontext(self.signals) if self.signals else StopSignals(second_ctrl_c_aborts=False) \
                as signals:
            for g in range(t, total, T):
                if ended >= mine:
                    break
                q, d = divmod(g, D)
                while len(pos_of_q) <= q:
                    pos_of_q.append(next(positions))
                drafter_rank = ctx.drafter_ranks[d]
                if drafter_rank in ended or not sender.wait_credit(drafter_rank, g):
                    ended.add(drafter_rank)
                    continue
                epoch, index = pos_of_q[q]
                rows = plan.shard(epoch, d, D)[index]
                batch = build_batch(self.data.train, rows, epoch=epoch, index=index)
                if self.padding is not None:
                    batch = batch.pad_to(*self.padding)
                c0 = time.perf_counter()
                if signals.received is None:
                    out = self.runner.run_batch(batch, ctx.device)
                    tensors = [out.taps] + ([out.final_hidden] if out.final_hidden is not None else [])
                    tokens += batch.num_tokens
                else:  # placeholders: the drafters discard this step and stop
                    R, S = batch.input_ids.shape
                    width = len(self.runner.layer_ids) * self.runner.hidden_size
                    dtype = next(self.runner.model.parameters()).dtype
                    tensors = [torch.zeros(R, S, width, dtype=dtype, device=ctx.device)]
                    if self.runner.need_final:
                        tensors.append(torch.zeros(R, S, self.runner.hidden_size, dtype=dtype, device=ctx.device))
                if ctx.device.type == "cuda":
                    torch.cuda.current_stream().synchronize()  # honest compute time (once per batch)
                compute_s += time.perf_counter() - c0
                sender.stats.busy_ms.append((time.perf_counter() - c0) * 1000)
                sender.send(drafter_rank, g, tensors, stop_request=signals.received is not None)
            # every drafter ends its stream with END: read what is left of each
            for drafter_rank in sorted(mine - ended):
                if sender.wait_credit(drafter_rank, -1):
                    raise RuntimeError(f"drafter rank {drafter_rank} credited a batch past the end of the plan")
            sender.flush()
        wall = time.perf_counter() - wall0
        return {"role": "target", "rank": ctx.rank, "batches": sender.stats.items, "tokens": tokens,
                "compute_s": compute_s, "wall_s": wall, "load_s": self.load_s, "tok_per_s": tokens / max(wall, 1e-9),
                **sender.stats.as_dict(), "stop_signal": signals.received}
