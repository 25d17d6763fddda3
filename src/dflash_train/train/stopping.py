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
* save due: run.save_every_minutes elapsed on the main drafter's clock (clocks differ).

A flag set on any replica is set on all, so they stop, skip or save at the same step.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
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
        self.last_save = time.perf_counter()
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

    def saved(self) -> None:
        self.last_save = time.perf_counter()

    def all_reduce_weight_and_stop(self, weight: torch.Tensor, loss: torch.Tensor, *, stop_requested: bool,
                                   redo: bool) -> WeightAndStop:
        """This replica's loss weight and loss sums and stop flags in; the drafter group's out."""
        now = time.perf_counter()
        out_of_time = bool(self.run.max_minutes) and (now - self.session_start) / 60 >= self.run.max_minutes
        save_due = (bool(self.run.save_every_minutes) and self.ctx.is_main_drafter
                    and (now - self.last_save) / 60 >= self.run.save_every_minutes)
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


FIT_MARGIN = 0.95  # of the time box left that the steps may fill: evaluations and saves take the rest


def box_left_s(session_elapsed_s: float, max_minutes: float) -> float:
    return max(max_minutes * 60 - session_elapsed_s, 0.0)


def steps_in_box(*, step: int, steps_per_s: float, session_elapsed_s: float, max_minutes: float) -> int:
    """The step the run reaches when FIT_MARGIN of the time box left is spent at the measured rate."""
    return step + int(steps_per_s * box_left_s(session_elapsed_s, max_minutes) * FIT_MARGIN)


def fitted_total(*, step: int, total: int, steps_per_s: float, session_elapsed_s: float, max_minutes: float) -> int:
    """run.fit_schedule: the schedule's length that the time box holds, at most `total` (the most
    the run does) and, below that, at least one step more than done."""
    fits = steps_in_box(step=step, steps_per_s=steps_per_s, session_elapsed_s=session_elapsed_s, max_minutes=max_minutes)
    return min(total, max(step + 1, fits))


REFIT_SHARE = 0.1  # a refit happens when the fitted length moves by more than this share of the steps left


def refit_due(*, step: int, current_total: int, fitted: int) -> bool:
    """Whether a newly fitted length replaces the current one: it moved by more than REFIT_SHARE of the
    steps left (and by more than 2 steps), so a steady rate's jitter does not move the cosine every window."""
    return abs(fitted - current_total) > max(2, REFIT_SHARE * (current_total - step))


RECENT_WINDOWS = 5  # log windows the fit's rate is taken over


class RecentRate:
    """The training rate the schedule's fit uses, from the end of the first log window (which holds
    the compiles) on: the median steps per second of the last RECENT_WINDOWS windows. A lasting change
    of speed (a generation beside the run ended, a load spike passed or began) moves it within a few
    windows; one slow window (a checkpoint, a held-out check) does not. The average since the first
    window lagged a whole slow stretch behind: after 5 minutes at half speed, a 14-minute run's
    cosine reached its floor ~200 steps early."""

    def __init__(self) -> None:
        self.last: tuple[int, float] | None = None  # (step, seconds) where the last window ended
        self.rates: deque[float] = deque(maxlen=RECENT_WINDOWS)

    def start(self, step: int, elapsed_s: float) -> None:
        self.last = (step, elapsed_s)
        self.rates.clear()

    def window_ended(self, step: int, elapsed_s: float) -> None:
        if self.last is None:
            return
        last_step, last_s = self.last
        if step > last_step and elapsed_s > last_s:
            self.rates.append((step - last_step) / (elapsed_s - last_s))
        self.last = (step, elapsed_s)

    def steps_per_s(self) -> float:
        return statistics.median(self.rates) if self.rates else 0.0


def schedule_fit(*, step: int, total: int, steps_per_s: float, session_elapsed_s: float,
                 max_minutes: float) -> str | None:
    """A line of advice when the learning-rate schedule does not fit run.max_minutes at the measured
    rate: the box will stop the run before the cosine has decayed (the drafter ends at a high
    learning rate), or the schedule ends with over a quarter of the box unused. The suggested
    run.max_steps fills FIT_MARGIN of the time left. None when
    there is no box or the schedule fits it."""
    if not max_minutes or steps_per_s <= 0 or step >= total:
        return None
    left_s = box_left_s(session_elapsed_s, max_minutes)
    need_s = (total - step) / steps_per_s
    fits = steps_in_box(step=step, steps_per_s=steps_per_s, session_elapsed_s=session_elapsed_s, max_minutes=max_minutes)
    head = (f"schedule: {total - step:,} more steps need ~{need_s / 60:.1f} min at the measured {steps_per_s:.2f} "
            f"steps/s; {left_s / 60:.1f} min of run.max_minutes={max_minutes:g} are left")
    if need_s > left_s:
        return (f"{head}: the time box will stop the run near step {fits:,} of {total:,}, before the learning rate "
                f"has decayed; --run.max_steps {fits:,} fits the schedule to the box")
    if need_s < 0.75 * left_s:
        return f"{head}: --run.max_steps {fits:,} (more epochs, or more data) would use the box"
    return None
