"""train/loader.py: batches read ahead on a thread, in order, errors handed over, and a close
that waits for the thread (a reader thread alive at interpreter exit can abort the process)."""

import logging
import threading

import pytest

import dflash_train.train.loader as loader_module
from dflash_train.train.loader import PrefetchLoader


def test_batches_arrive_in_order_and_then_the_end():
    loader = PrefetchLoader(iter(range(7)), depth=2)
    assert list(loader) == list(range(7))
    loader.close()


def test_an_error_on_the_thread_is_raised_in_the_consumer_after_the_batches_before_it():
    def batches():
        yield 0
        yield 1
        raise ValueError("shard 3: torn record")

    loader = PrefetchLoader(batches(), depth=4)
    assert [next(loader), next(loader)] == [0, 1]
    with pytest.raises(ValueError, match="torn record"):
        next(loader)
    loader.close()


class _SlowBatches:
    """Blocks inside the second batch until released; counts how many batches were started."""

    def __init__(self):
        self.started = 0
        self.inside = threading.Event()
        self.release = threading.Event()

    def __iter__(self):
        while True:
            self.started += 1
            if self.started == 2:
                self.inside.set()
                self.release.wait(10)
            yield self.started


def test_close_waits_for_the_batch_being_built_and_reads_no_further():
    batches = _SlowBatches()
    loader = PrefetchLoader(iter(batches), depth=1)
    assert next(loader) == 1
    assert batches.inside.wait(5)
    threading.Timer(0.3, batches.release.set).start()  # the batch takes 0.3 s more to build
    loader.close()
    assert not loader._thread.is_alive() and batches.started == 2


def test_a_thread_that_outlives_the_wait_is_reported(monkeypatch, caplog):
    monkeypatch.setattr(loader_module, "CLOSE_WAIT_S", 0.2)
    batches = _SlowBatches()
    loader = PrefetchLoader(iter(batches), depth=1)
    next(loader)
    assert batches.inside.wait(5)
    with caplog.at_level(logging.WARNING, logger="dflash_train.train.loader"):
        loader.close()
    assert "did not stop within" in caplog.text
    batches.release.set()
    loader._thread.join(5)
    assert not loader._thread.is_alive()


def test_prepare_runs_on_the_thread_for_every_batch_in_order():
    threads = set()

    def prepare(batch):
        threads.add(threading.current_thread().name)
        return batch * 10

    loader = PrefetchLoader(iter(range(5)), depth=2, prepare=prepare)
    assert list(loader) == [0, 10, 20, 30, 40]
    assert threads == {"dflash-loader"}
    loader.close()
