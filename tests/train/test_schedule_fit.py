"""The learning-rate schedule against run.max_minutes (train/schedule.py): the advice when they do not
fit each other, and run.fit_schedule, which fits one to the other once; exact values, real CPU runs."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch

import dflash_train.train.schedule as schedule_mod
from dflash_train.train.checkpoint import latest_checkpoint, step_dir_name
from dflash_train.train.metrics_log import first_step_line
import dflash_train.train.stopping as stopping_mod
from dflash_train.train.schedule import RecentRate, fitted_total, refit_due, schedule_fit
from dflash_train.train.trainer import Trainer

from .test_trainer import make_config, read_metrics


def test_a_schedule_longer_than_the_box_is_cut_and_the_fitting_step_count_named() -> None:
    # 2,000 steps left at 4 steps/s need 500 s; 600 s box, 200 s gone: 400 s left
    msg = schedule_fit(step=200, total=2200, steps_per_s=4.0, session_elapsed_s=200.0, max_minutes=10)
    assert msg is not None
    assert "2,000 more steps need ~8.3 min" in msg and "6.7 min of run.max_minutes=10 are left" in msg
    assert "stop the run near step 1,720 of 2,200" in msg  # 200 + int(4 * 400 * 0.95)
    assert msg.endswith("--run.max_steps 1,720 fits the schedule to the box")


def test_a_schedule_that_leaves_over_a_quarter_of_the_box_unused_says_so() -> None:
    # run 3a of docs/recipe-smollm2.md: 1,478 steps at ~6.5 steps/s in a 7.5-minute box
    msg = schedule_fit(step=200, total=1478, steps_per_s=6.5, session_elapsed_s=70.0, max_minutes=7.5)
    assert msg is not None
    assert "--run.max_steps 2,546 (more epochs, or more data) would use the box" in msg  # 200 + int(6.5 * 380 * 0.95)


def test_no_advice_when_the_schedule_fits_or_there_is_no_box() -> None:
    # 1,000 steps at 4/s = 250 s of 300 s left: between 75% and 100% of the box
    assert schedule_fit(step=0, total=1000, steps_per_s=4.0, session_elapsed_s=0.0, max_minutes=5) is None
    assert schedule_fit(step=0, total=1000, steps_per_s=4.0, session_elapsed_s=0.0, max_minutes=0) is None
    assert schedule_fit(step=1000, total=1000, steps_per_s=4.0, session_elapsed_s=0.0, max_minutes=5) is None
    assert schedule_fit(step=5, total=1000, steps_per_s=0.0, session_elapsed_s=0.0, max_minutes=5) is None
    # the box already spent: every remaining step is past it
    late = schedule_fit(step=10, total=20, steps_per_s=1.0, session_elapsed_s=400.0, max_minutes=5)
    assert late is not None and "stop the run near step 10 of 20" in late


def test_a_cpu_run_with_a_long_box_prints_the_advice_after_its_second_log_window(
        tiny_targets, tiny_datasets, tmp_path, caplog) -> None:
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "run",
                      **{"run.max_steps": 4, "run.log_every": 1, "run.max_minutes": 30})
    with caplog.at_level(logging.INFO):
        Trainer(cfg).fit()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("schedule:")]
    assert len(lines) == 1, lines  # once, at step 2
    m = re.search(r"^schedule: 2 more steps need .* --run\.max_steps ([\d,]+) \(more epochs", lines[0])
    assert m and int(m.group(1).replace(",", "")) > 4


def test_fitted_total_is_capped_by_the_most_the_run_does_and_moves_at_least_one_step() -> None:
    assert fitted_total(step=200, total=5000, steps_per_s=4.0, session_elapsed_s=200.0, max_minutes=10) == 1720
    assert fitted_total(step=200, total=1000, steps_per_s=4.0, session_elapsed_s=200.0, max_minutes=10) == 1000
    assert fitted_total(step=200, total=1000, steps_per_s=4.0, session_elapsed_s=900.0, max_minutes=10) == 201
    assert fitted_total(step=1000, total=1000, steps_per_s=4.0, session_elapsed_s=900.0, max_minutes=10) == 1000


def fit_config(targets, datasets, out, **extra):
    return make_config(targets["llama"], datasets["llama"], out, **{
        "run.max_steps": 20, "run.max_minutes": 30, "run.fit_schedule": True, "run.log_every": 1,
        "run.save_every": 4, "optim.warmup_steps": 2, "optim.min_lr_ratio": 0.1, **extra})


def test_a_fitted_schedule_is_the_run_that_had_that_many_steps_from_the_start(
        tiny_targets, tiny_datasets, tmp_path, monkeypatch, caplog) -> None:
    """The fit happens at step 2, still in the warm-up, so the fitted run must equal, step for step,
    a run configured with the fitted length (the reference); the checkpoint keeps the length."""
    calls = []
    monkeypatch.setattr(schedule_mod, "fitted_total", lambda **box: calls.append(box) or 7)
    with caplog.at_level(logging.INFO):
        summary = Trainer(fit_config(tiny_targets, tiny_datasets, tmp_path / "fit")).fit()
    # fitted at step 2, then offered again at every log window: the same length is no refit
    assert calls[0]["step"] == 2 and all(c["total"] == 20 for c in calls) and len(calls) == 6
    assert not any("refitted" in r.getMessage() for r in caplog.records)
    assert any(r.getMessage().startswith("schedule fitted to run.max_minutes=30: 7 steps (the most is 20)")
               for r in caplog.records)
    assert summary["steps"] == 7
    Trainer(make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "ref", **{
        "run.max_steps": 7, "run.log_every": 1, "run.save_every": 4, "optim.warmup_steps": 2,
        "optim.min_lr_ratio": 0.1})).fit()
    fit, ref = read_metrics(tmp_path / "fit"), read_metrics(tmp_path / "ref")
    assert sorted(fit) == sorted(ref) == list(range(1, 8))
    for step in ref:
        assert fit[step]["lr"] == ref[step]["lr"] and fit[step]["loss"] == ref[step]["loss"], step
    assert fit[7]["lr"] == pytest.approx(0.1 * 3e-3)  # the cosine ran to its end
    assert json.loads((latest_checkpoint(tmp_path / "fit" / "checkpoints") / "state.json").read_text()
                      )["train_state"]["fitted_total"] == 7


def test_a_resumed_run_keeps_its_fitted_schedule(tiny_targets, tiny_datasets, tmp_path, monkeypatch) -> None:
    out = tmp_path / "fit"
    monkeypatch.setattr(schedule_mod, "fitted_total", lambda **box: 7)
    Trainer(fit_config(tiny_targets, tiny_datasets, out)).fit()
    before = read_metrics(out)
    for step_dir in (out / "checkpoints").iterdir():  # back to the step-4 checkpoint, as if stopped there
        if step_dir.name != step_dir_name(4):
            shutil.rmtree(step_dir)
    shutil.rmtree(out / "final")
    monkeypatch.setattr(schedule_mod, "fitted_total", lambda **box: pytest.fail("the schedule was fitted again"))
    summary = Trainer(fit_config(tiny_targets, tiny_datasets, out), resume=True).fit()
    after = read_metrics(out)
    assert summary["steps"] == 7 and sorted(after) == list(range(1, 8))
    assert all(after[s]["lr"] == before[s]["lr"] for s in range(5, 8))


def test_fit_schedule_without_a_time_box_keeps_max_steps(tiny_targets, tiny_datasets, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(schedule_mod, "fitted_total", lambda **box: pytest.fail("fitted without a time box"))
    cfg = fit_config(tiny_targets, tiny_datasets, tmp_path / "x", **{"run.max_minutes": 0, "run.max_steps": 3})
    assert Trainer(cfg).fit()["steps"] == 3


def test_the_rate_counts_from_the_end_of_the_first_window_and_a_refit_needs_a_real_move() -> None:
    rate = RecentRate()
    rate.window_ended(5, 10.0)
    assert rate.steps_per_s() == 0.0  # not started: the first window holds the compiles
    rate.start(2, 40.0)  # the first window ended at step 2, 40 s in
    rate.window_ended(12, 60.0)
    assert rate.steps_per_s() == 0.5
    rate.window_ended(12, 60.0)  # an empty window adds no rate
    assert rate.steps_per_s() == 0.5
    assert not refit_due(step=10, current_total=50, fitted=54)  # 4 of 40 steps left: jitter
    assert refit_due(step=10, current_total=50, fitted=55) and refit_due(step=10, current_total=50, fitted=45)
    assert not refit_due(step=48, current_total=50, fitted=52) and refit_due(step=48, current_total=50, fitted=53)


def test_the_rate_is_the_median_of_the_recent_windows() -> None:
    rate = RecentRate()
    rate.start(0, 0.0)
    step, t = 0, 0.0
    for seconds in (10.0, 10.0, 10.0, 10.0, 10.0, 2.0, 2.0, 2.0, 20.0):  # 10 steps a window
        step, t = step + 10, t + seconds
        rate.window_ended(step, t)
        if step == 70:  # the last five windows: 1, 1, 1, 5, 5 steps/s
            assert rate.steps_per_s() == 1.0
        if step == 80:  # 1, 1, 5, 5, 5: the faster speed counts after three windows
            assert rate.steps_per_s() == 5.0
    # one slow window (a checkpoint) does not move it, where the average since the start
    # (90 steps in 76 s) would still say 1.18
    assert rate.steps_per_s() == 5.0


class FakeClock:
    """perf_counter for train/stopping.py: the seconds the steps done so far cost (`cost(step)`)."""

    def __init__(self, cost):
        self.cost, self.trainer = cost, None

    def perf_counter(self) -> float:
        return sum(self.cost(i) for i in range(1, self.trainer.state.step + 1)) if self.trainer else 0.0


def _fit_under_clock(tiny_targets, tiny_datasets, out, monkeypatch, cost, **extra):
    clock = FakeClock(cost)
    monkeypatch.setattr(stopping_mod, "time", clock)
    trainer = Trainer(fit_config(tiny_targets, tiny_datasets, out, **{"run.max_minutes": 1, "run.max_steps": 200,
                                                                      "run.save_every": 1000, **extra}))
    clock.trainer = trainer
    return trainer, trainer.fit()


def test_a_load_spike_at_the_first_fit_is_refitted_once_the_speed_recovers(
        tiny_targets, tiny_datasets, tmp_path, monkeypatch, caplog) -> None:
    """The demo's failure: fitted during a spike (10 s a step), the box then held many more steps at
    the recovered speed (0.5 s). The schedule grows with the measured rate and ends decayed in the box."""
    with caplog.at_level(logging.INFO):
        trainer, summary = _fit_under_clock(tiny_targets, tiny_datasets, tmp_path / "run", monkeypatch,
                                            lambda step: 10.0 if step <= 3 else 0.5)
    fits = [int(m.group(1).replace(",", "")) for r in caplog.records
            if (m := re.match(r"schedule (?:re)?fitted to run.max_minutes=1: ([\d,]+) steps", r.getMessage()))]
    assert fits[0] == 5  # at step 2: 0.1 steps/s measured since step 1, 40 s left: 2 + int(0.1 * 40 * 0.95)
    assert len(fits) > 2 and fits[-1] > 30 and fits == sorted(fits)
    assert summary["steps"] == fits[-1] == trainer.total_steps  # ended by its schedule, inside the box
    m = read_metrics(tmp_path / "run")
    assert m[summary["steps"]]["lr"] == pytest.approx(0.1 * 3e-3)  # the cosine ran to its end


def test_a_steady_rate_is_fitted_once(tiny_targets, tiny_datasets, tmp_path, monkeypatch, caplog) -> None:
    with caplog.at_level(logging.INFO):
        _, summary = _fit_under_clock(tiny_targets, tiny_datasets, tmp_path / "run", monkeypatch, lambda step: 2.0)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("schedule ")]
    # 0.5 steps/s from step 1 on; at step 2, 56 s left: 2 + int(0.5 * 56 * 0.95) = 28
    assert lines == ["schedule fitted to run.max_minutes=1: 28 steps (the most is 200) at the measured 0.50 steps/s"]
    assert summary["steps"] == 28


def test_a_slow_start_that_ends_is_followed_so_the_cosine_spans_the_run(
        tiny_targets, tiny_datasets, tmp_path, monkeypatch, caplog) -> None:
    """A generation beside the run for its first part (2 s a step, then 0.25 s): the fit follows the
    new speed within a few windows, so the cosine spans the whole box. The average since the first
    window chased it in 33 fits, the learning rate near its floor from the second third on."""
    with caplog.at_level(logging.INFO):
        _, summary = _fit_under_clock(tiny_targets, tiny_datasets, tmp_path / "run", monkeypatch,
                                      lambda step: 2.0 if step <= 10 else 0.25, **{"run.max_steps": 400})
    fits = [int(m.group(1).replace(",", "")) for r in caplog.records
            if (m := re.match(r"schedule (?:re)?fitted to run.max_minutes=1: ([\d,]+) steps", r.getMessage()))]
    # 10 steps in 20 s, then 40 s at 4 steps/s: 10 + int(4 * 40 * 0.95) = 162 once the new speed counts
    assert fits[0] == 28 and 162 <= fits[1] <= 170 and len(fits) <= 4
    assert summary["steps"] == fits[-1]
    m = read_metrics(tmp_path / "run")
    mid = summary["steps"] // 2
    assert m[mid]["lr"] > 0.5 * 3e-3  # half-way through a cosine from 3e-3 to 3e-4: 1.65e-3
    assert m[summary["steps"]]["lr"] == pytest.approx(0.1 * 3e-3)


def test_the_first_step_is_announced_once_before_the_first_log_window(
        tiny_targets, tiny_datasets, tmp_path, caplog) -> None:
    """One line after the first optimizer step (the compiles' wait is over; on a GPU, the memory held),
    before step 1's log window, and not again on later steps; a resumed process says it again."""
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "run",
                      **{"run.max_steps": 3, "run.log_every": 1, "run.save_every": 2})
    with caplog.at_level(logging.INFO):
        Trainer(cfg).fit()
    messages = [r.getMessage() for r in caplog.records]
    firsts = [i for i, m in enumerate(messages) if m.startswith("first step")]
    assert len(firsts) == 1, messages
    assert re.fullmatch(r"first step done \d+\.\ds after the start", messages[firsts[0]])  # CPU: no memory part
    step1 = next(i for i, m in enumerate(messages) if m.startswith("step 1/3 |"))
    assert firsts[0] < step1
    caplog.clear()
    more = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "run",
                       **{"run.max_steps": 4, "run.log_every": 1, "run.save_every": 2})
    with caplog.at_level(logging.INFO):
        Trainer(more, resume=True).fit()
    assert len([m for m in (r.getMessage() for r in caplog.records) if m.startswith("first step")]) == 1


def test_the_first_step_line_on_a_gpu_names_the_memory_held(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 48.46 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 50.04 * 2**30)
    assert first_step_line(61.27, torch.device("cuda", 0)) == (
        "first step done 61.3s after the start; peak memory 48.5 GiB allocated, 50.0 GiB reserved")
    assert first_step_line(3.04, torch.device("cpu")) == "first step done 3.0s after the start"
