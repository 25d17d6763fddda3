"""utils/parallel.py: the order-keeping process map gives what a loop gives."""

import multiprocessing as mp
import os
import sys

import pytest

from dflash_train.utils.parallel import cores_of_this_process, ordered_map

_PROBE = "as imported"


def _square_and_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_ordered_map_keeps_the_tasks_order_and_runs_in_worker_processes_when_asked(workers):
    tasks = list(range(40, 0, -1))
    out = ordered_map(_square_and_pid, tasks, workers)
    assert [value for value, _ in out] == [x * x for x in tasks]
    pids = {pid for _, pid in out}
    assert pids == {os.getpid()} if workers == 1 else os.getpid() not in pids  # a pool's processes did it


def test_ordered_map_runs_too_few_tasks_here():
    out = ordered_map(_square_and_pid, [3, 1, 2], 2)  # fewer than two a worker: no pool to start
    assert out == [(9, os.getpid()), (1, os.getpid()), (4, os.getpid())]


def _probe(_) -> str:
    return _PROBE


def test_fresh_processes_are_spawned_where_fork_would_copy_the_parent(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "_PROBE", "set in the parent")
    fresh = ordered_map(_probe, [0, 1, 2, 3], 2, fresh_processes=True)
    assert fresh == ["as imported"] * 4  # a new interpreter imported this module afresh
    if "fork" in mp.get_all_start_methods():
        assert ordered_map(_probe, [0, 1, 2, 3], 2) == ["set in the parent"] * 4  # forked: the parent's memory


def test_per_worker_sets_how_few_tasks_start_a_pool():
    assert {pid for _, pid in ordered_map(_square_and_pid, [1, 2], 2)} == {os.getpid()}
    out = ordered_map(_square_and_pid, [1, 2], 2, per_worker=1)
    assert [v for v, _ in out] == [1, 4] and os.getpid() not in {pid for _, pid in out}


def test_cores_of_this_process_is_the_ranks_share(monkeypatch):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cores_of_this_process() == cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert cores_of_this_process() == max(1, cores // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10 * cores))
    assert cores_of_this_process() == 1
