"""The learning-rate schedule's length against the time box (run.max_minutes).

`ScheduleFit` keeps the schedule's length (`total`, read by the learning-rate schedule at every
step, train/optimizer.py) and its own time, the log windows: the first holds the compiles and
starts the measured rate; from the second on, with run.fit_schedule, the length is fitted to
what the box holds at the recent rate (and refitted when that rate moves the fit), the same
length on every drafter replica; without it, a line of advice says once when the two do not fit.
"""

from __future__ import annotations

import statistics
from collections import deque

import torch
import torch.distributed as dist

from dflash_train.pipeline.context import DistContext
from dflash_train.train.config import RunConfig
from dflash_train.train.metrics_log import MetricsLogger

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


class ScheduleFit:
    """The schedule's length and its fit to run.max_minutes (see the module's docstring)."""

    def __init__(self, run: RunConfig, ctx: DistContext, *, most_steps: int):
        self.run, self.ctx = run, ctx
        self.most_steps = most_steps  # the most the run does: run.max_steps, or the epochs' steps
        self.total = most_steps
        self.fitted_before = False  # resumed from a run that fitted its schedule: it continues as fitted
        self.fitted_here = False
        self.rate = RecentRate()
        self.windows = 0  # log windows seen by this process

    def resumed(self, fitted_total: int) -> None:
        """A resumed run's checkpoint records the length it fitted (0: none): the schedule keeps it."""
        if fitted_total:
            self.fitted_before = True
            self.total = min(self.most_steps, fitted_total)

    def window_logged(self, step: int, session_elapsed_s: float, metrics: MetricsLogger) -> int | None:
        """At the end of each log window: the new length when it was fitted or refitted here, else None."""
        self.windows += 1
        if self.windows == 1:  # the first window holds the compiles: the rate counts from its end
            self.rate.start(step, session_elapsed_s)
            return None
        self.rate.window_ended(step, session_elapsed_s)
        box = dict(step=step, total=self.most_steps, steps_per_s=self.rate.steps_per_s(),
                   session_elapsed_s=session_elapsed_s, max_minutes=self.run.max_minutes)
        if not (self.run.fit_schedule and self.run.max_minutes) or self.fitted_before:
            if self.windows == 2:  # said once
                metrics.line(schedule_fit(**{**box, "total": self.total}) or "")
            return None
        fitted = self._agreed(fitted_total(**box))
        if self.fitted_here and not refit_due(step=step, current_total=self.total, fitted=fitted):
            return None
        verb = "refitted" if self.fitted_here else "fitted"
        metrics.line(f"schedule {verb} to run.max_minutes={self.run.max_minutes:g}: {fitted:,} steps (the most is "
                     f"{self.most_steps:,}) at the measured {box['steps_per_s']:.2f} steps/s")
        self.total, self.fitted_here = fitted, True
        metrics.set_total(fitted)
        return fitted

    def _agreed(self, fitted: int) -> int:
        """The replicas must end at one step: the slowest one's count, so every replica decides alike."""
        if self.ctx.num_drafters == 1:
            return fitted
        agreed = torch.tensor(fitted, device=self.ctx.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.ctx.drafters)
        return int(agreed)
