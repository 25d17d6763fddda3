"""A target sharded with FSDP2 under the packed compiled forward on GPUs (NCCL, CUDA streams,
Inductor), which the gloo tests on the CPU cannot reach: over every visible GPU (one is a group of
one), its taps and final norm equal the whole model's compiled packed forward, and each rank holds
1/G of the weights after the forwards. Skipped without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
WORKER = Path(__file__).with_name("sharded_gpu_worker.py")


@needs_gpu
def test_packed_compiled_forward_of_a_sharded_target_equals_the_whole_one_on_gpus():
    world = min(torch.cuda.device_count(), 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}",
           "--standalone", str(WORKER)]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["world"] == world
    assert max(max(d) for d in report["diffs"]) <= 1e-2, report  # the same bf16 kernels: equal or nearly
    assert abs(report["held"] - 1 / world) < 0.01, report
