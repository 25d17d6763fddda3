"""The learning-rate schedules, value by value: warmup, then cosine or warmup-stable-decay."""

import math

import pytest
import torch

from dflash_train.train.config import OptimConfig
from dflash_train.train.optimizer import build_lr_scheduler, lr_factor


def test_cosine_values():
    # warmup 4 of 14: (s+1)/4, then 0.1 + 0.9 * (1 + cos(pi * (s - 4) / 10)) / 2
    got = [lr_factor(s, warmup=4, total=14, min_ratio=0.1) for s in range(16)]
    want = [0.25, 0.5, 0.75, 1.0] + [0.1 + 0.45 * (1 + math.cos(math.pi * min(s - 4, 10) / 10)) for s in range(4, 16)]
    assert got == pytest.approx(want)


def test_wsd_values():
    # total 20, decay_fraction 0.25: warmup on steps 0-2, the peak up to step 15, then
    # 1 - 0.9 * (s - 15) / 5 (min_ratio at step 20, the first past the schedule, as cosine's)
    got = [lr_factor(s, warmup=3, total=20, min_ratio=0.1, schedule="wsd", decay_fraction=0.25) for s in range(23)]
    want = [1 / 3, 2 / 3] + [1.0] * 14 + [1 - 0.9 * k / 5 for k in range(1, 5)] + [0.1] * 3
    assert got == pytest.approx(want)


def test_wsd_decay_never_starts_inside_the_warmup():
    # decay 0.9 of 10 steps would start at step 1; it starts after the 5 warmup steps instead
    got = [lr_factor(s, warmup=5, total=10, min_ratio=0.0, schedule="wsd", decay_fraction=0.9) for s in range(10)]
    assert got == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2])


def test_scheduler_follows_the_config_and_a_changing_total():
    total = [40]
    cfg = OptimConfig(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.5)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_lr_scheduler(opt, cfg, lambda: total[0])
    lrs = []
    for step in range(10):
        if step == 5:
            total[0] = 10  # run.fit_schedule shortens the run mid-way: the decay moves with it
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([1.0, 1.0, 1.0, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.0])


@pytest.mark.parametrize("bad, message", [
    ({"schedule": "linear"}, "optim.schedule must be cosine or wsd, got 'linear'"),
    ({"decay_fraction": 0.0, "schedule": "wsd"}, r"optim.decay_fraction must be in \(0, 1\], got 0.0"),
    ({"decay_fraction": 1.5, "schedule": "wsd"}, r"optim.decay_fraction must be in \(0, 1\], got 1.5"),
    ({"decay_fraction": 0.5}, r"optim.decay_fraction \(0.5\) applies to optim.schedule wsd; optim.schedule is 'cosine'"),
])
def test_bad_schedule_settings_are_refused_naming_the_field_at_fault(bad, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**bad)
