"""pipeline/context.py's GPU-sharing rule, decided before NCCL is asked: which local ranks share
a GPU (then no eager NCCL communicator: NCCL refuses two ranks on one device), and the
ConfigError when two drafters would (their gradient all-reduce is NCCL's)."""

import itertools
import os
import random
import subprocess
import sys

import pytest
import torch

from dflash_train.pipeline.context import gpus_shared_on_node, one_of_several_processes
from dflash_train.utils.errors import ConfigError


def gpu(i: int) -> torch.device:
    return torch.device("cuda", i)


def brute_force(devices, first_rank, drafters):
    """(shared, drafter pair on one GPU or None) by comparing every pair of local ranks."""
    shared, clash = False, None
    for a, b in itertools.combinations(range(len(devices)), 2):
        if devices[a].type == "cuda" and devices[a] == devices[b]:
            shared = True
            if clash is None and first_rank + a in drafters and first_rank + b in drafters:
                clash = (first_rank + a, first_rank + b)
    return shared, clash


def test_layouts_of_one_node():
    # four ranks, four GPUs: nothing shared
    assert gpus_shared_on_node([gpu(i) for i in range(4)], 0, [0, 1, 2, 3]) is False
    # split 1 + 1 on one GPU: a target and a drafter share it (the measured one-GPU split layout)
    assert gpus_shared_on_node([gpu(0), gpu(0)], 0, [1]) is True
    # CPU ranks share nothing NCCL could refuse
    assert gpus_shared_on_node([torch.device("cpu")] * 3, 0, [0, 1, 2]) is False
    # colocated, two ranks on one GPU: refused, naming both ranks and how many GPUs there are
    with pytest.raises(ConfigError, match=r"drafter ranks 0, 1 would share cuda:0: .*--nproc-per-node 1\)"):
        gpus_shared_on_node([gpu(0), gpu(0)], 0, [0, 1])
    # the second node of a job (global ranks 4..7) on two GPUs, split with drafters 6 and 7
    with pytest.raises(ConfigError, match=r"drafter ranks 5, 7 would share cuda:1: .*--nproc-per-node 2\)"):
        gpus_shared_on_node([gpu(0), gpu(1), gpu(0), gpu(1)], 4, [5, 7])
    assert gpus_shared_on_node([gpu(0), gpu(1), gpu(0), gpu(1)], 4, [6, 7]) is True


def test_random_nodes_against_every_pair():
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 6)
        devices = [torch.device("cpu") if rng.random() < 0.15 else gpu(rng.randrange(3)) for _ in range(n)]
        first = rng.choice([0, 6, 12])
        drafters = [r for r in range(first, first + n) if rng.random() < 0.5]
        shared, clash = brute_force(devices, first, drafters)
        if clash is None:
            assert gpus_shared_on_node(devices, first, drafters) is shared, (devices, first, drafters)
        else:
            with pytest.raises(ConfigError, match=f"drafter ranks .*{clash[0]}, .*{clash[1]}"):
                gpus_shared_on_node(devices, first, drafters)


EXIT_SCRIPT = """
import atexit, logging, sys
from dflash_train.pipeline.context import exit_finished_rank
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(message)s")
atexit.register(lambda: print("finalised", flush=True))
print("summary line", end="")  # left in the buffer: a pipe is block-buffered
logging.getLogger("x").info("last log line")
sys.stderr.write("unflushed stderr")
exit_finished_rank()
print("never")
"""


def test_a_finished_rank_ends_with_its_output_flushed_and_without_finalisation():
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as a rank's pipe is
    proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=60,
                          env={**env, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0
    assert proc.stdout == "summary line"  # no "never", no "finalised": atexit (finalisation) never ran
    assert "last log line" in proc.stderr and proc.stderr.endswith("unflushed stderr")


@pytest.mark.parametrize("env, several", [({}, False), ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, False),
                                          ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, True)])
def test_one_of_several_processes_is_a_torchrun_job_of_two_or_more(env, several, monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert one_of_several_processes() is several
