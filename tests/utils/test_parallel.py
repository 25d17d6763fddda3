"""utils/parallel.py: the order-keeping process map gives what a loop gives."""

import os

import pytest

from dflash_train.utils.parallel import ordered_map


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
