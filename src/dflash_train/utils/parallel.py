"""An order-keeping map over worker processes, for CPU-bound jobs of many small tasks (parsing
thousands of source files) or a few large ones (a dataset's rows in slices): the result is the
same with one worker or many."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def ordered_map(fn: Callable[[T], R], tasks: Sequence[T], workers: int, *, per_worker: int = 2,
                fresh_processes: bool = False) -> list[R]:
    """`fn(task)` of every task, in the tasks' order. With `workers` > 1 and at least `per_worker`
    tasks a worker, in that many processes; fewer tasks run here, since a pool's start costs more
    than it saves. Workers are forked where the platform can, else spawned (a new interpreter
    each: `fn` and the tasks must then pickle, so `fn` is a module-level function).
    `fresh_processes`: never forked from this process, which may hold threads (a training rank's
    CUDA, NCCL or torch pools) whose locks a fork would copy mid-flight. They come from a fork
    server instead where the platform has one (a single-threaded process started once, which
    forks each worker in milliseconds), else spawned; `fn` and the tasks must pickle."""
    if workers <= 1 or len(tasks) < per_worker * workers:
        return [fn(task) for task in tasks]
    methods = mp.get_all_start_methods()
    if fresh_processes:
        ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    else:
        ctx = mp.get_context("fork" if "fork" in methods else "spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        return list(pool.map(fn, tasks, chunksize=max(1, min(64, len(tasks) // (8 * workers)))))


def cores_of_this_process() -> int:
    """This process's share of the node's cores: the cores it may run on, divided among the
    ranks torchrun started on the node (LOCAL_WORLD_SIZE), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))
