"""An order-keeping map over worker processes, for CPU-bound jobs of many small tasks (parsing
thousands of source files): the result is the same with one worker or many."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(fn: Callable[[T], R], tasks: Sequence[T], workers: int) -> list[R]:
    """`fn(task)` of every task, in the tasks' order. With `workers` > 1 and at least two tasks a
    worker, in that many processes (forked where the platform can, else spawned: `fn` and the
    tasks must then pickle, so `fn` is a module-level function); fewer tasks run here, since a
    pool's start costs more than it saves."""
    if workers <= 1 or len(tasks) < 2 * workers:
        return [fn(task) for task in tasks]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        return list(pool.map(fn, tasks, chunksize=max(1, min(64, len(tasks) // (8 * workers)))))
