"""train/setup.py's resolve_attention: step.attention -> the drafter's mask kind, per device and
head width (FlexAttention: no CPU backward; its GPU kernels need heads of >= 16 dims)."""

import logging

import pytest
import torch

from dflash_train.train.setup import resolve_attention
from dflash_train.utils.errors import TrainingError
from dflash_train.utils.flex_masks import FLEX_MIN_HEAD_DIM

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU


@pytest.mark.parametrize("requested, device, head_dim, expected", [
    ("auto", GPU, 128, "flex"),
    ("auto", GPU, 16, "flex"),
    ("auto", GPU, 15, "dense"),
    ("auto", GPU, 8, "dense"),
    ("auto", CPU, 128, "dense"),
    ("auto", CPU, 8, "dense"),
    ("dense", GPU, 128, "dense"),
    ("dense", CPU, 8, "dense"),
    ("flex", GPU, 16, "flex"),
])
def test_choices(requested, device, head_dim, expected):
    assert FLEX_MIN_HEAD_DIM == 16
    assert resolve_attention(requested, device, head_dim) == expected


def test_a_narrow_drafter_on_a_gpu_says_why_it_is_dense(caplog):
    with caplog.at_level(logging.INFO, logger="dflash_train.train.setup"):
        resolve_attention("auto", GPU, 8)
    assert any("heads of 8 dims: the dense attention mask (FlexAttention's GPU kernels need >= 16)" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("device, head_dim, message", [
    (CPU, 128, "step.attention=flex needs a GPU: FlexAttention has no backward on CPU; use dense"),
    (GPU, 8, "step.attention=flex needs drafter heads of >= 16 dims .* this drafter's are 8: use step.attention auto"),
])
def test_flex_where_it_cannot_run_is_refused(device, head_dim, message):
    with pytest.raises(TrainingError, match=message):
        resolve_attention("flex", device, head_dim)
