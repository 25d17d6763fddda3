"""utils/device.to_device_async: the same values on the device; on a GPU from pinned memory
(the source is left as it was). The GPU case is skipped without CUDA."""

import pytest
import torch

from dflash_train.utils.device import to_device_async


def test_a_cpu_destination_is_a_plain_move():
    t = torch.arange(6).view(2, 3)
    assert to_device_async(t, torch.device("cpu")) is t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_copy_has_the_values_and_leaves_the_source_pageable():
    t = torch.arange(100_000, dtype=torch.int64)
    out = to_device_async(t, torch.device("cuda"))
    assert out.device.type == "cuda" and not t.is_pinned()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), t)
