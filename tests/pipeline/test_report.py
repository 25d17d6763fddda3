"""The split layout's bottleneck report (pipeline/report.py): the side that limits a run is the
one that sustains fewer batches per second, whatever the start-up queue waits say."""

from __future__ import annotations

import pytest

from dflash_train.bench.cli import BenchConfig
from dflash_train.pipeline.context import DistContext
from dflash_train.pipeline.report import pipeline_report


def split_ctx(targets: int, drafters: int) -> DistContext:
    return DistContext(layout="split", world=targets + drafters, target_ranks=list(range(targets)),
                       drafter_ranks=list(range(targets, targets + drafters)))


def ranks(targets: list[float], drafters: list[float], t_wait: float, d_wait: float) -> list[dict]:
    rows = [{"rank": i, "role": "target", "median_busy_ms_per_batch": ms, "queue_wait_s": t_wait}
            for i, ms in enumerate(targets)]
    return rows + [{"rank": len(targets) + i, "role": "drafter", "median_busy_ms_per_batch": ms,
                    "queue_wait_s": d_wait} for i, ms in enumerate(drafters)]


def test_the_slower_side_is_the_bottleneck_even_when_it_waited_longest():
    # the H200 run: the target filled its queue while the drafter compiled, then waited 30.7 s
    out = pipeline_report(split_ctx(1, 1), ranks([280.0], [209.0], t_wait=30.7, d_wait=1.3))
    assert out["bottleneck"] == "targets" and out["balanced_targets"] == 1
    assert "1 target(s) sustain 3.57 batches/s and 1 drafter(s) 4.78" in out["text"]


def test_rates_count_ranks_and_the_advice_balances_them():
    # 5 targets at 500 ms sustain 10 batches/s, 3 drafters at 200 ms 15: targets limit; 8 ranks
    # balance at 8 * 500 / 700 = 5.7 -> 6 targets
    out = pipeline_report(split_ctx(5, 3), ranks([500.0] * 5, [200.0] * 3, t_wait=0.0, d_wait=9.0))
    assert out["bottleneck"] == "targets" and out["balanced_targets"] == 6
    out = pipeline_report(split_ctx(5, 3), ranks([100.0] * 5, [200.0] * 3, t_wait=9.0, d_wait=0.0))
    assert out["bottleneck"] == "drafters" and out["balanced_targets"] == 3  # 8 * 100 / 300 = 2.7


def test_without_busy_times_the_waits_decide():
    out = pipeline_report(split_ctx(1, 1), ranks([0.0], [0.0], t_wait=0.5, d_wait=4.0))
    assert out["bottleneck"] == "targets" and out["balanced_targets"] is None


def test_split_bench_refuses_to_measure_the_start_up_queue():
    with pytest.raises(ValueError, match=r"--warmup \(3\) must exceed --queue-depth \(4\)"):
        BenchConfig(layout="split", warmup=3, measure=6)
    assert BenchConfig(layout="split", warmup=5, measure=10).warmup == 5
    assert BenchConfig(layout="colocated", warmup=3, measure=6).warmup == 3  # no queue there
