"""What the step calls: `wrap_drafter` compiles with Inductor's autotuning only when asked,
and then only for the kernels Inductor generates (matmuls stay cuBLAS). Compiling itself is
GPU work (docs/performance.md measures it); here torch.compile is replaced by a recorder."""

import pytest
import torch

from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.train import setup
from dflash_train.pipeline.context import DistContext


@pytest.fixture
def recorded(monkeypatch):
    calls = []

    def fake_compile(model, **kwargs):
        calls.append(kwargs)
        return model

    monkeypatch.setattr(torch, "compile", fake_compile)
    return calls


def tiny_drafter():
    return DFlashDrafter(DrafterConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                       intermediate_size=32, vocab_size=11, target_layer_ids=[0],
                                       num_target_layers=2, mask_token_id=10, num_hidden_layers=1))


@pytest.mark.parametrize("compile,autotune,want", [
    (False, False, []),
    (True, False, [{}]),
    (True, True, [{"options": {"max_autotune": True, "max_autotune_gemm_backends": "ATEN"}}]),
])
def test_compile_and_autotune_options(recorded, compile, autotune, want):
    drafter = tiny_drafter()
    model = setup.wrap_drafter(drafter, DistContext(layout="single", device=torch.device("cpu")), compile=compile,
                               autotune=autotune)
    assert model is drafter and recorded == want
