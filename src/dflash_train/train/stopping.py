"""When a run stops or saves, decided the same way on every drafter replica, once per step.

Each step the replicas exchange one small vector, `StopControl.all_reduce_weight_and_stop`
(one all-reduce on the drafter group):

    [loss weight sum, loss sum, interrupt, redo, out of time, save due]

* the loss weight and loss sums of the global batch: the gradient normaliser, and a
  finiteness test that comes out the same everywhere (a NaN anywhere is a NaN in the sum);
* interrupt: SIGINT/SIGTERM here, or a target rank asked to stop (split layout);
* redo: a target sent stop-request placeholders instead of hidden states: this step is
  discarded and redone after `--resume`;
* out of time: run.max_minutes reached (a normal end: final drafter and evaluation);
* save due: the main drafter's checkpointer says a timed save is due (run.save_every_minutes,
  train/checkpoint.py; clocks differ, the main drafter's decides).

A flag set on any replica is set on all, so they stop, skip or save at the same step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Self

import torch
import torch.distributed as dist

from dflash_train.pipeline.context import DistContext
from dflash_train.train.config import RunConfig
from dflash_train.utils.signals import StopSignals

STOP_ANNOUNCE = "finishing this step, saving a checkpoint, then exiting (Ctrl-C again to stop without saving)"


@dataclass
class WeightAndStop:
    """What the step's one all-reduce carries: the global loss weight and loss, and the stop flags."""

    weight: torch.Tensor  # global loss weight sum of the step
    loss: torch.Tensor  # global loss sum of the step
    interrupt: bool
    redo: bool
    out_of_time: bool
    save_due: bool

    @property
    def stop(self) -> bool:
        return self.interrupt or self.redo or self.out_of_time


class StopControl:
    """Signals, the time limit, remote stop requests and timed saves, agreed per step."""

    def __init__(self, run: RunConfig, ctx: DistContext, *, elapsed_before_s: float = 0.0,
                 signals: StopSignals | None = None):
        self.run, self.ctx = run, ctx
        # the process's recorder when the job installed one for its whole life (train/run.py)
        self._own_signals = signals is None
        self.signals = signals or StopSignals(announce=STOP_ANNOUNCE)
        self.start = time.perf_counter() - elapsed_before_s  # of this run, resumed parts included
        self.session_start = time.perf_counter()
        self.reason: str | None = None  # why the run was interrupted (None: it was not)

    def __enter__(self) -> Self:
        if self._own_signals:
            self.signals.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._own_signals:
            self.signals.__exit__(*exc)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.start

    def session_elapsed_s(self) -> float:
        """Seconds since this process started training: run.max_minutes counts from here."""
        return time.perf_counter() - self.session_start

    def all_reduce_weight_and_stop(self, weight: torch.Tensor, loss: torch.Tensor, *, stop_requested: bool,
                                   redo: bool, save_due: bool = False) -> WeightAndStop:
        """This replica's loss weight and loss sums and stop flags in; the drafter group's out."""
        out_of_time = bool(self.run.max_minutes) and self.session_elapsed_s() / 60 >= self.run.max_minutes
        interrupt = self.signals.received is not None or stop_requested
        flags = [interrupt, redo, out_of_time, save_due]
        if self.ctx.num_drafters > 1:
            vec = torch.stack([weight.float().reshape(()), loss.float().reshape(()),
                               *(torch.tensor(float(f), device=weight.device) for f in flags)])
            dist.all_reduce(vec, group=self.ctx.drafters)
            weight, loss = vec[0], vec[1]
            flags = (vec[2:] > 0).tolist()
        agreed = WeightAndStop(weight, loss, *flags)
        if agreed.interrupt or agreed.redo:
            self.reason = self.reason or self.signals.received or (
                "stop request" if stop_requested or redo else "a stop on another rank")
        return agreed
