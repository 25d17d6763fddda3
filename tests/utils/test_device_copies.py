"""utils/device.to_device_async and copy_values_async: the same values on the device; on a GPU
from pinned memory (the source is left as it was). The GPU cases are skipped without CUDA."""

import pytest
import torch

from dflash_train.utils.device import copy_values_async, to_device_async


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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_values_land_in_the_buffer_slice_in_its_dtype(device):
    buf = torch.full((10,), -1.0, device=device)
    out = copy_values_async(buf[2:6], [1, 2, 3, 4])
    assert out.data_ptr() == buf[2:].data_ptr() and out.dtype == torch.float32
    assert buf.cpu().tolist() == [-1, -1, 1, 2, 3, 4, -1, -1, -1, -1]
