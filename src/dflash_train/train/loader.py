"""Batches read ahead on a background thread, so the training loop never waits on disk.

The thread only reads Arrow shards and builds CPU tensors (`prepare`d, e.g. padded to the
compiled shape, then pinned on GPU runs, so that their copies to the GPU never make the host
wait): no compiled code and no CUDA kernels run on it, which is what made multi-threaded
compiled pipelines fail. Errors on the thread are re-raised in the
consumer, never swallowed, and the thread stops when the consumer closes the loader.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

from dflash_train.data.batch import PackedBatch

_END = object()
# How long close() waits for the batch being built. A thread still inside a C++ call (Arrow, torch)
# when the interpreter exits aborts the process ("terminate called without an active
# exception"), so the wait is long; a batch takes milliseconds to build.
CLOSE_WAIT_S = 60.0
log = logging.getLogger(__name__)


class PrefetchLoader:
    def __init__(self, batches: Iterator[PackedBatch], depth: int = 2, pin_memory: bool = False,
                 prepare: Callable[[PackedBatch], PackedBatch] | None = None):
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._pin = pin_memory
        self._prepare = prepare
        self._thread = threading.Thread(target=self._run, args=(batches,), daemon=True, name="dflash-loader")
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, batches: Iterator[PackedBatch]) -> None:
        try:
            for batch in batches:
                if self._prepare is not None:
                    batch = self._prepare(batch)
                if self._pin:
                    batch = batch.pin_memory()
                if not self._put(batch):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer
            self._put(exc)

    def __iter__(self) -> "PrefetchLoader":
        return self

    def __next__(self) -> PackedBatch:
        item = self._queue.get()
        if item is _END:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=CLOSE_WAIT_S)
        if self._thread.is_alive():
            log.warning("the batch reader thread did not stop within %.0f s (a stalled read?); the process may "
                        "abort when it exits", CLOSE_WAIT_S)
