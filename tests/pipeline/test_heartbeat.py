"""pipeline/heartbeat.py: stop() outlasts a store call in flight (a thread still inside a C++
store call when the interpreter exits aborts the process)."""

import threading
import time

import torch.distributed as dist

from dflash_train.pipeline.heartbeat import Heartbeat


class _SlowStore(dist.Store):
    """A store whose calls take 0.6 s once `slow` is set (a loaded or distant store host)."""

    def __init__(self):
        super().__init__()
        self.inner = dist.HashStore()
        self.slow, self.inside = threading.Event(), threading.Event()

    def add(self, key, value):
        if self.slow.is_set():
            self.inside.set()
            time.sleep(0.6)
        return self.inner.add(key, value)

    def set(self, key, value):
        return self.inner.set(key, value)

    def get(self, key):
        return self.inner.get(key)


def test_stop_waits_for_the_store_call_in_flight():
    store = _SlowStore()
    beat = Heartbeat(0, 2, interval_s=0.05, dead_after_s=100, store=store).start()
    time.sleep(0.2)
    store.slow.set()
    assert store.inside.wait(5)
    beat.stop()  # 12 heartbeat intervals of store calls: more than a few intervals, less than the store's timeout
    assert not beat._thread.is_alive()
    assert beat.verdict is None  # stopping is not a death


def test_each_rank_counts_its_beats_in_the_store_until_stopped():
    store = dist.HashStore()
    beats = dist.PrefixStore("dflash-heartbeat", store)
    beat = Heartbeat(1, 2, interval_s=0.05, dead_after_s=100, store=store).start()
    deadline = time.monotonic() + 10
    while beats.add("1", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    beat.stop()
    counted = beats.add("1", 0)
    time.sleep(0.2)
    assert counted >= 3 and beats.add("1", 0) == counted
