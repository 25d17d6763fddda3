"""LocalTargetSource with `pipeline.overlap_target`: the same batches and target outputs in the
same order, the next batch's target forward launched before this batch is handed out. On a
GPU that launch goes to a second stream; the order of work tested here is the same."""

import pytest
import torch

from dflash_train.pipeline.sources import LocalTargetSource
from dflash_train.target.runner import TargetOutput
from dflash_train.train.timing import StageTimer


class Batch:
    def __init__(self, i):
        self.index = i


class Loader:
    """Batches 0..n-1, then StopIteration (or `error` at batch `fail_at`); must not be read past its end."""

    def __init__(self, n, fail_at=None):
        self.n, self.i, self.fail_at, self.ended, self.closed = n, 0, fail_at, False, False

    def __next__(self):
        assert not self.ended, "the loader was read again after its end"
        if self.i == self.fail_at:
            self.ended = True
            raise ValueError(f"bad batch {self.i}")
        if self.i >= self.n:
            self.ended = True
            raise StopIteration
        self.i += 1
        return Batch(self.i - 1)

    def close(self):
        self.closed = True


class Runner:
    def __init__(self, log):
        self.log = log

    def run_batch(self, batch, device):
        self.log.append(("target", batch.index))
        return TargetOutput(torch.full((1, 2, 3), float(batch.index)), None)


def _drain(overlap, loader):
    log = []
    source = LocalTargetSource(loader, Runner(log), torch.device("cpu"), overlap=overlap)
    timer = StageTimer(torch.device("cpu"))
    got = []
    while True:
        try:
            batch, out, placeholder = source.next(timer)
        except StopIteration:
            break
        assert not placeholder and float(out.taps[0, 0, 0]) == batch.index
        log.append(("drafter", batch.index))
        got.append(batch.index)
    source.close()
    assert loader.closed
    return got, log


def test_overlap_hands_out_the_same_batches_with_the_target_one_ahead():
    plain, plain_log = _drain(False, Loader(4))
    ahead, ahead_log = _drain(True, Loader(4))
    assert plain == ahead == [0, 1, 2, 3]
    assert plain_log == [("target", 0), ("drafter", 0), ("target", 1), ("drafter", 1), ("target", 2), ("drafter", 2),
                         ("target", 3), ("drafter", 3)]
    # batch k + 1's forward is launched before batch k's drafter step
    assert ahead_log == [("target", 0), ("target", 1), ("drafter", 0), ("target", 2), ("drafter", 1),
                         ("target", 3), ("drafter", 2), ("drafter", 3)]


def test_overlap_on_empty_data_and_a_data_error_at_its_place():
    assert _drain(True, Loader(0))[0] == []
    log = []
    source = LocalTargetSource(Loader(5, fail_at=2), Runner(log), torch.device("cpu"), overlap=True)
    timer = StageTimer(torch.device("cpu"))
    assert [source.next(timer)[0].index for _ in range(2)] == [0, 1]  # batch 2's error was met reading ahead ...
    with pytest.raises(ValueError, match="bad batch 2"):  # ... and is raised where batch 2 would be
        source.next(timer)
