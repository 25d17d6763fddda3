"""gpu_idle: busy/idle totals and gap attribution on hand-built traces with known answers, and a
brute-force check of the busy union against a per-microsecond timeline."""

import random

from dflash_train.train import gpu_idle


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace():
    """Host: train_step [0, 100) > forward [0, 60) > aten::nonzero [20, 45), then backward [60, 100).
    Device: k1 [5, 25), k2 [10, 30) (overlaps k1, ends later), a copy [30, 32), a gap to k3 [50, 70)
    launched inside aten::nonzero after a cudaStreamSynchronize that ended at 48, a gap to k4
    [71, 90) launched in backward with no blocking call."""
    return [
        _x("user_annotation", "train_step", 0, 100), _x("user_annotation", "forward", 0, 60),
        _x("cpu_op", "aten::nonzero", 20, 45 - 20), _x("user_annotation", "backward", 60, 40),
        _x("cuda_runtime", "cudaLaunchKernel", 1, 1, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 2, 1, correlation=2),
        _x("cuda_runtime", "cudaMemcpyAsync", 25, 48 - 25, correlation=3),  # blocking, ends at 48
        _x("cuda_runtime", "cudaLaunchKernel", 44, 1, correlation=4),
        _x("cuda_driver", "cuLaunchKernelEx", 61, 1, correlation=5),
        _x("kernel", "k1", 5, 20, tid=7, correlation=1), _x("kernel", "k2", 10, 20, tid=7, correlation=2),
        _x("gpu_memcpy", "copy", 30, 2, tid=7, correlation=3),
        _x("kernel", "k3", 50, 20, tid=7, correlation=4), _x("kernel", "k4", 71, 19, tid=8, correlation=5),
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 50, "id": 4},  # flow events are ignored
    ]


def test_totals_and_gaps_are_exact():
    s = gpu_idle.summarize(_trace())
    assert s.window_us == 85 and s.busy_us == 27 + 20 + 19 and s.idle_us == 19
    assert [(g.start_us, g.idle_us) for g in s.gaps] == [(32, 18), (70, 1)]
    first, second = s.gaps
    assert (first.before, first.after) == ("copy", "k3")
    assert first.launched_in == "train_step > forward > aten::nonzero"
    assert first.waited_in == "cudaMemcpyAsync"
    assert (second.before, second.after, second.launched_in, second.waited_in) == ("k3", "k4", "train_step > backward", "")


def test_report_groups_by_launch_site_per_step():
    text = gpu_idle.report(gpu_idle.summarize(_trace()), steps=2, min_gap_us=5)
    assert "0.04 ms per step, busy 0.03, idle 0.01 (22.4%) in 2 gaps" in text
    assert "   0.009     1  train_step > forward > aten::nonzero  [after cudaMemcpyAsync]" in text
    assert "train_step > backward" not in text.split("largest gaps")[0]  # the 1 us gap is below min_gap_us
    assert "0.00 ms per step in smaller gaps" in text


def test_a_cpu_trace_has_no_device_timeline():
    assert gpu_idle.summarize([_x("cpu_op", "aten::mm", 0, 5)]) is None
    assert "CPU run" in gpu_idle.report(None, steps=1)


def test_busy_union_matches_a_brute_force_timeline():
    rng = random.Random(0)
    for _ in range(50):
        ops = [(rng.randrange(0, 200), rng.randrange(1, 30)) for _ in range(rng.randrange(1, 12))]
        events = [_x("kernel", f"k{i}", ts, dur, correlation=i) for i, (ts, dur) in enumerate(ops)]
        busy = set(t for ts, dur in ops for t in range(ts, ts + dur))
        lo, hi = min(ts for ts, _ in ops), max(ts + dur for ts, dur in ops)
        s = gpu_idle.summarize(events)
        assert s.busy_us == len(busy) and s.window_us == hi - lo
        assert sum(g.idle_us for g in s.gaps) == hi - lo - len(busy)
        assert all(g.launched_in == "?" for g in s.gaps)  # no launch events in this trace
