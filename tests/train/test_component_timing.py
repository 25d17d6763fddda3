"""Each training component keeps its own time: the checkpointer saves at every save_every-th step,
when a timed save is due and at the end; the step log writes every log_every-th step and the last;
the evaluator runs every eval_every-th step, once per step; the schedule fit acts at log windows.
Exact steps, exact values; the last tests run the trainer on the CPU and read what it left."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import torch

import dflash_train.train.checkpoint as ck
from dflash_train.drafter.loss import StepStats
from dflash_train.pipeline.context import DistContext
from dflash_train.pipeline.sources import SourcedBatch
from dflash_train.train import setup as setup_mod
from dflash_train.train.config import RunConfig, TrainConfig
from dflash_train.train.evaluate import Evaluator
from dflash_train.train.metrics_log import MetricsLogger, StepLog
from dflash_train.train.schedule import ScheduleFit
from dflash_train.train.step import StepKind, StepOutcome
from dflash_train.train.timing import StageTimer
from dflash_train.train.trainer import Trainer

from .test_checkpoint_safety import parts
from .test_trainer import make_config, read_metrics

CPU = torch.device("cpu")


class Clock:
    """time.perf_counter for a module under test: seconds set by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def checkpointer(root, **kw) -> ck.Checkpointer:
    m, opt, sch = parts()
    return ck.Checkpointer(root, drafter=m, optimizer=opt, scheduler=sch, config={"run": {"seed": 0}},
                           **{"every": 3, "keep_last": 100, **kw})


def saved_steps(root) -> list[int]:
    return [step for step, _ in ck.step_dirs(root)]


# -- the checkpointer ----------------------------------------------------------------------------


def test_maybe_save_saves_at_every_nth_step_when_due_and_at_the_last(tmp_path):
    c, lines = checkpointer(tmp_path), []
    paths = {}
    for step in range(1, 11):
        state = ck.TrainState(step=step)
        paths[step] = c.maybe_save(state, lines.append, due=step == 4, last=step == 10)
    assert saved_steps(tmp_path) == [3, 4, 6, 9, 10]
    assert [s for s, p in paths.items() if p is not None] == [3, 4, 6, 9, 10]
    assert lines == [f"saved {tmp_path / ck.step_dir_name(s)}" for s in (3, 4, 6, 9, 10)]
    # the end of a run right after a save point: that checkpoint, verified, not written again
    assert c.maybe_save(ck.TrainState(step=9), lines.append, last=True) == tmp_path / ck.step_dir_name(9)
    assert len(lines) == 5


def test_only_the_main_drafter_writes_and_run_checkpoint_false_writes_nothing(tmp_path):
    for kw in ({"main": False}, {"enabled": False}):
        c, lines = checkpointer(tmp_path / str(kw), **kw), []
        assert [c.maybe_save(ck.TrainState(step=s), lines.append, last=s == 4) for s in range(1, 5)] == [None] * 4
        assert saved_steps(tmp_path / str(kw)) == [] and lines == []


def test_the_timed_save_is_due_every_so_many_minutes_since_the_last_save_point(tmp_path, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(ck, "time", clock)
    c = checkpointer(tmp_path, every=1000, every_minutes=1.0, enabled=False)
    clock.now = 59.9
    assert not c.timed_save_due()
    clock.now = 60.0
    assert c.timed_save_due()
    c.maybe_save(ck.TrainState(step=7), lambda line: None, due=True)  # a save point, written or not
    clock.now = 119.9
    assert not c.timed_save_due()
    clock.now = 120.0
    assert c.timed_save_due()
    c.maybe_save(ck.TrainState(step=1000), lambda line: None)  # a save_every step resets the clock too
    assert not c.timed_save_due()
    assert not checkpointer(tmp_path, every_minutes=1.0, main=False).timed_save_due()  # the main drafter's clock
    assert not checkpointer(tmp_path, every_minutes=0.0).timed_save_due()


# -- the step log -------------------------------------------------------------------------------------


def step_stats(loss: float) -> list[StepStats]:
    """One micro-batch: loss sum `loss` over weight 1; B = 4 (three slots)."""
    return [StepStats.from_flat(torch.tensor([loss, 1.0, loss, 2.0, 1.0] + [1.0, 1.0, 0.0] * 3))]


def test_maybe_log_writes_every_mth_step_and_the_last(tmp_path, caplog):
    metrics = MetricsLogger(tmp_path, total_steps=8, start_step=0, tensorboard=False, progress=False)
    log = StepLog(metrics, StageTimer(CPU), every=3, block_size=4, group=None, num_drafters=1, device=CPU,
                  clock=lambda: 1.5)
    logged = []
    with caplog.at_level(logging.INFO):
        for step in range(1, 9):
            log.step_done(step, step_stats(float(step)), tokens=10)
            if log.maybe_log(step, total=8, lr=1e-3, grad_norm=torch.tensor(0.5)):
                logged.append(step)
    assert logged == [3, 6, 8] and log.windows == 3
    records = read_metrics(tmp_path)
    assert sorted(records) == [3, 6, 8]
    # each record is its own window's: the mean loss of steps 1-3, 4-6, 7-8
    assert [records[s]["loss"] for s in (3, 6, 8)] == [2.0, 5.0, 7.5]
    assert [records[s]["window_tokens"] for s in (3, 6, 8)] == [30, 30, 20]
    assert records[8]["grad_norm"] == 0.5 and records[8]["lr"] == 1e-3 and log.last["loss"] == 7.5
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == "first step done 1.5s after the start"  # once, after the first step
    assert [m.split(" |")[0] for m in said[1:]] == ["step 3/8", "step 6/8", "step 8/8"]


def test_a_schedule_shortened_mid_run_is_logged_at_its_new_last_step(tmp_path):
    metrics = MetricsLogger(tmp_path, total_steps=100, start_step=0, tensorboard=False, progress=False)
    log = StepLog(metrics, StageTimer(CPU), every=10, block_size=4, group=None, num_drafters=1, device=CPU,
                  clock=lambda: 0.0)
    for step in range(1, 8):
        log.step_done(step, step_stats(1.0), tokens=1)
    assert not log.maybe_log(6, total=100, lr=0.0, grad_norm=torch.tensor(0.0))
    assert log.maybe_log(7, total=7, lr=0.0, grad_norm=torch.tensor(0.0))
    assert sorted(read_metrics(tmp_path)) == [7]


# -- the evaluator ------------------------------------------------------------------------------------


def evaluator(monkeypatch, *, every: int, **target) -> tuple[Evaluator, list[int]]:
    cfg = TrainConfig(run=RunConfig(eval_every=every))
    measured: list[int] = []
    monkeypatch.setattr(Evaluator, "measure",
                        lambda self, drafter, step, metrics, tokens_seen=None: measured.append(step) or {"at": step})
    target = SimpleNamespace(**{"runner": object(), "sharded": False, **target})
    return Evaluator(cfg, None, target, None, None, CPU, padding=None, num_drafters=1), measured


def test_maybe_evaluate_runs_every_eth_step_once_per_step(monkeypatch):
    ev, measured = evaluator(monkeypatch, every=2)
    results = [ev.maybe_evaluate(None, step, None) for step in range(1, 7)]
    assert measured == [2, 4, 6]
    assert results == [None, {"at": 2}, None, {"at": 4}, None, {"at": 6}]
    assert ev.evaluate(None, 6) == {"at": 6} and measured == [2, 4, 6]  # the end right after step 6's: once
    assert ev.evaluate(None, 7) == {"at": 7} and measured == [2, 4, 6, 7]


def test_without_eval_every_only_the_end_evaluates_and_only_with_the_whole_target(monkeypatch):
    ev, measured = evaluator(monkeypatch, every=0)
    assert [ev.maybe_evaluate(None, step, None) for step in range(1, 5)] == [None] * 4 and measured == []
    for target in ({"runner": None}, {"sharded": True}):
        ev, measured = evaluator(monkeypatch, every=1, **target)
        assert ev.maybe_evaluate(None, 1, None) == {} and ev.evaluate(None, 2) == {} and measured == []


# -- the schedule fit ---------------------------------------------------------------------------------


class Lines:
    def __init__(self) -> None:
        self.lines, self.total = [], None

    def line(self, text: str) -> None:
        if text:
            self.lines.append(text)

    def set_total(self, total: int) -> None:
        self.total = total


def test_the_schedule_is_fitted_at_the_second_log_window_and_refitted_only_when_the_rate_moves_it():
    fit, out = ScheduleFit(RunConfig(max_minutes=1, fit_schedule=True), DistContext("single"), most_steps=200), Lines()
    assert fit.window_logged(2, 10.0, out) is None and fit.total == 200  # the compiles' window: the rate starts
    # 2 steps in 4 s: 0.5 steps/s; 46 s left: 4 + int(0.5 * 46 * 0.95) = 25
    assert fit.window_logged(4, 14.0, out) == 25 and fit.total == out.total == 25
    assert out.lines == ["schedule fitted to run.max_minutes=1: 25 steps (the most is 200) at the measured "
                         "0.50 steps/s"]
    assert fit.window_logged(6, 18.0, out) is None  # 6 + int(0.5 * 42 * 0.95) = 25: the same length
    # one fast window does not move the median rate (0.5), but the box has moved on: 16 + int(0.5 * 41 * 0.95)
    assert fit.window_logged(16, 19.0, out) == 35 and out.lines[-1].startswith("schedule refitted to ")


def test_a_resumed_fitted_schedule_keeps_its_length_and_without_fit_schedule_advice_is_said_once():
    fit, out = ScheduleFit(RunConfig(max_minutes=1, fit_schedule=True), DistContext("single"), most_steps=200), Lines()
    fit.resumed(40)
    assert fit.total == 40
    assert [fit.window_logged(step, 2.0 * step, out) for step in (2, 4, 6, 8)] == [None] * 4
    assert fit.total == 40 and out.total is None and len(out.lines) == 1 and out.lines[0].startswith("schedule: ")
    fit, out = ScheduleFit(RunConfig(max_minutes=1), DistContext("single"), most_steps=200), Lines()
    assert [fit.window_logged(step, 2.0 * step, out) for step in (2, 4, 6, 8)] == [None] * 4
    assert fit.total == 200 and len(out.lines) == 1 and "the time box will stop the run" in out.lines[0]


# -- the step outcome ---------------------------------------------------------------------------------


def test_only_a_redo_or_no_batch_ends_a_run():
    assert [StepOutcome(kind).ends_run for kind in StepKind] == [
        kind in (StepKind.REDO, StepKind.NO_DATA) for kind in StepKind]
    assert {kind.value for kind in StepKind} == {"applied", "nonfinite", "redo", "no_data"}


# -- the trainer, on the CPU ------------------------------------------------------------------------


def test_a_run_saves_logs_and_evaluates_at_its_components_steps(tiny_targets, tiny_datasets, tmp_path):
    out = tmp_path / "run"
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], out, **{
        "run.max_steps": 7, "run.save_every": 3, "run.log_every": 2, "run.eval_every": 3, "run.keep_last": 10,
        "data.eval_fraction": 0.1, "data.plan.token_budget": 256, "eval.spec_prompts": "null"})
    summary = Trainer(cfg).fit()
    assert saved_steps(out / "checkpoints") == [3, 6, 7]
    assert sorted(read_metrics(out)) == [2, 4, 6, 7]
    assert sorted(read_metrics(out, "eval")) == [3, 6, 7]
    assert summary["steps"] == 7 and summary["checkpoint"] == str(out / "checkpoints" / ck.step_dir_name(7))


class SignalAt:
    """StopSignals as a job installs them, with a SIGTERM recorded once the trainer reaches `step`."""

    def __init__(self, step: int) -> None:
        self.step, self.trainer = step, None

    @property
    def received(self) -> str | None:
        return "SIGTERM" if self.trainer is not None and self.trainer.state.step >= self.step else None


def test_a_stop_saves_at_the_step_it_is_agreed_and_nothing_more(tiny_targets, tiny_datasets, tmp_path):
    out, signals = tmp_path / "run", SignalAt(5)
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], out, **{
        "run.max_steps": 12, "run.save_every": 3, "run.log_every": 4, "run.keep_last": 10})
    trainer = Trainer(cfg, signals=signals)
    signals.trainer = trainer
    summary = trainer.fit()
    # the flag set after step 5 is agreed in step 6's all-reduce: step 6 applied, then saved once
    assert summary["interrupted_by"] == "SIGTERM" and summary["steps"] == 6
    assert saved_steps(out / "checkpoints") == [3, 6] and not (out / "final").exists()
    assert sorted(read_metrics(out)) == [4]


def test_a_redo_step_applies_nothing_and_puts_the_data_cursor_back(tiny_targets, tiny_datasets, tmp_path,
                                                                    monkeypatch):
    """Placeholders from a stopping target (split layout): the step is not applied, the run stops, and
    its checkpoint points at the batch to redo."""
    build = setup_mod.build_batch_source

    class PlaceholderAt:
        def __init__(self, source, at: int) -> None:
            self.source, self.at, self.calls = source, at, 0
            self.stop_requested = False

        def next(self, timer) -> SourcedBatch:
            self.calls += 1
            got = self.source.next(timer)
            return SourcedBatch(got.batch, got.target, self.calls == self.at)

        def stats(self) -> dict:
            return self.source.stats()

        def close(self) -> None:
            self.source.close()

    monkeypatch.setattr(setup_mod, "build_batch_source", lambda *a, **k: PlaceholderAt(build(*a, **k), at=3))
    out = tmp_path / "run"
    trainer = Trainer(make_config(tiny_targets["llama"], tiny_datasets["llama"], out, **{
        "run.max_steps": 12, "run.save_every": 100, "data.plan.token_budget": 256}))
    summary = trainer.fit()
    assert summary["steps"] == 2 and summary["interrupted_by"] == "stop request"
    state = json.loads((out / "checkpoints" / ck.step_dir_name(2) / "state.json").read_text())["train_state"]
    assert (state["index"], state["batches"]) == (2, 2)  # the third batch is read again on resume
    assert sorted(read_metrics(out)) == [1, 2]
