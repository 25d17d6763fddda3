"""CPU threads of a rank (utils/device.py choose_cpu_threads)."""

from __future__ import annotations

import os

import pytest
import torch

from dflash_train.utils.device import choose_cpu_threads


@pytest.fixture
def threads_back():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("ranks, expected", [(4, 4), (3, 5), (32, 1)])
def test_ranks_on_one_node_share_its_cores(monkeypatch, threads_back, ranks, expected):
    """Four ranks started together each see 16 idle cores: without a share, 4 x 16 OpenMP threads
    spin against each other on 16 cores (the pipeline tests stalled on a 16-core GPU host)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    torch.set_num_threads(16)  # torch's default on 16 cores without OMP_NUM_THREADS
    threads, why = choose_cpu_threads(0)
    assert threads == expected == torch.get_num_threads() and f"{ranks} ranks" in why


def test_an_explicit_thread_count_wins(monkeypatch, threads_back):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert choose_cpu_threads(3) == (3, "as requested") and torch.get_num_threads() == 3
