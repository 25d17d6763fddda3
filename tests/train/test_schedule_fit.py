"""The trainer's advice when the learning-rate schedule and run.max_minutes do not fit each other
(train/stopping.py: schedule_fit), with exact values, and the line in a real CPU run."""

from __future__ import annotations

import logging
import re

from dflash_train.train.stopping import schedule_fit
from dflash_train.train.trainer import Trainer

from .test_trainer import make_config


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
