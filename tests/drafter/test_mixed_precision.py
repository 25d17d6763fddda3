"""The GPU recipe's dtypes on CPU: fp32 drafter weights, bf16 target tensors, bf16 autocast.

q, k and v must reach the attention kernel in one dtype (FlexAttention, unlike SDPA, is
not an autocast op), and the frozen bf16 LM head must never be copied to fp32."""

import random

import pytest
import torch

import dflash_train.drafter.masks as masks
from dflash_train.drafter.loss import LossConfig, summarize
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.drafter.step import FrozenHeads, StepConfig, drafter_step
from dflash_train.target.runner import TargetOutput

from .reference import random_packed_layout
from .test_model import packed, tiny_config


@pytest.mark.parametrize("backend", ["dense", "flex"])
@pytest.mark.parametrize("labels", ["data", "target", "distill"])
def test_step_under_bf16_autocast(backend, labels, monkeypatch):
    if backend == "flex":  # eager FlexAttention on CPU: forward only, no compilation
        monkeypatch.setattr(masks, "compiled_once", lambda fn, **options: fn)
    torch.manual_seed(0)
    model = DFlashDrafter(tiny_config())
    ids, pos, doc, loss = random_packed_layout(random.Random(0), 2, 40)
    ids = ids % 22
    g = torch.Generator().manual_seed(0)
    heads = FrozenHeads(torch.randn(23, 16, generator=g).bfloat16(), torch.randn(23, 16, generator=g).bfloat16())
    taps = torch.randn(2, 40, 48, generator=g).bfloat16()
    final = torch.randn(2, 40, 16, generator=g).bfloat16()
    grad = torch.enable_grad() if backend == "dense" else torch.no_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16), grad:
        stats = drafter_step(model, heads, packed(ids, pos, doc, loss), TargetOutput(taps, final),
                             step_cfg=StepConfig(num_anchors=6, attention=backend, label_source=labels, noise_sigma=0.1),
                             loss_cfg=LossConfig(), generator=torch.Generator().manual_seed(1))
    m = summarize(stats)
    assert torch.isfinite(torch.tensor(m["loss"])) and m["labels"] > 0
    if backend == "dense":
        stats.loss_sum.backward()
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
