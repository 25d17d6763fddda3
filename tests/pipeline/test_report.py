"""The split layout's bottleneck report (pipeline/report.py): the side that limits a run is the
one that sustains fewer batches per second, whatever the start-up queue waits say; the split
bench reports no more than the targets sustain."""

from __future__ import annotations

import pytest

from dflash_train.pipeline.context import DistContext
from dflash_train.pipeline.report import pipeline_report, targets_tokens_per_s
from dflash_train.train.run import print_summary


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


def test_split_bench_reports_what_the_targets_sustain_when_the_drafters_ate_a_queued_stock():
    # the H200 run (qwen3-8b, 1+1, 8192-token batches): the drafters measured 39.4K tok/s on
    # batches the target queued while they compiled; the target needs 281.56 ms a batch
    report = pipeline_report(split_ctx(1, 1), ranks([281.56], [212.64], t_wait=29.6, d_wait=1.2))
    assert report["targets_batches_per_s"] == pytest.approx(1000 / 281.56)
    assert report["drafters_batches_per_s"] == pytest.approx(1000 / 212.64)
    assert targets_tokens_per_s(report, 8192) == pytest.approx(8192 * 1000 / 281.56)  # 29,095
    # several targets add up: 5 at 500 ms feed 10 batches/s
    report = pipeline_report(split_ctx(5, 3), ranks([500.0] * 5, [200.0] * 3, t_wait=0.0, d_wait=9.0))
    assert targets_tokens_per_s(report, 100) == pytest.approx(1000.0)


def test_no_target_rate_without_a_split_or_without_busy_times():
    colocated = DistContext(layout="colocated", world=2, target_ranks=[0, 1], drafter_ranks=[0, 1])
    assert targets_tokens_per_s(pipeline_report(colocated, []), 8192) is None
    assert targets_tokens_per_s({}, 8192) is None  # a single process has no pipeline report
    idle = pipeline_report(split_ctx(1, 1), ranks([0.0], [0.0], t_wait=0.5, d_wait=4.0))
    assert targets_tokens_per_s(idle, 8192) is None


def test_a_short_split_runs_summary_says_what_the_targets_sustain(capsys):
    # SmolLM2 split 1+1 on two H200s: 12 steps of 2,048 tokens at 176K tok/s, the target needs
    # 13.67 ms a batch (73.16 batches/s: 149.8K tok/s)
    report = pipeline_report(split_ctx(1, 1), ranks([13.669], [12.486], t_wait=6.7, d_wait=0.3))
    report["ranks"][1]["batches"] = 12
    summary = {"steps": 12, "tokens": 24576, "elapsed_s": 7.1, "tok_per_s": 24576 / 7.1,
               "last_window_tok_per_s": 176078.0, "pipeline": report, "checkpoint": "runs/x/checkpoints/step-00000012"}
    print_summary(summary)
    out = capsys.readouterr().out
    assert "steps 12, 24,576 tokens in 7.1s (3,461 tok/s; last log window 176,078)" in out
    assert "split: the targets sustain 149,828 tok/s" in out
    # a long run: the measured rate within 5% of what the targets sustain, no correction printed
    print_summary({**summary, "last_window_tok_per_s": 1.04 * 73.159 * 2048})
    assert "sustain" not in capsys.readouterr().out
