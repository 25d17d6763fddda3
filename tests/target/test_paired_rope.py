"""ERNIE 4.5's rotary embedding (target/ops.py `apply_rope(paired=True)`, target/language_model.py
PAIRED_ROPE): each pair of neighbouring dims turned by one frequency, the tables kept in float32,
in bfloat16 too: bit for bit transformers' own function, whose layout (evens and odds in place)
differs from Llama's halves and from DeepSeek's (evens, then odds)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.target.language_model import PAIRED_ROPE, layer_rope_tables, rope_table
from dflash_train.target.ops import apply_rope
from tests.families import build_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paired_rope_equals_ernies_own_in_its_dtype(dtype):
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import apply_rotary_pos_emb

    model = build_model("ernie4_5_moe", 64)
    assert layer_rope_tables(model.config) == [PAIRED_ROPE] * model.config.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    positions = torch.arange(40)[None]
    q = torch.randn(1, 4, 40, 16, generator=gen).mul(3).to(dtype)  # [B, heads, S, D], as transformers holds it
    k = torch.randn(1, 2, 40, 16, generator=gen).mul(3).to(dtype)
    cos, sin = model.model.rotary_emb(q, positions)  # float32, whatever the input's dtype
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours_cos, ours_sin = rope_table(model.model.rotary_emb, q, positions, PAIRED_ROPE)
    ours_cos, ours_sin = ours_cos[:, None], ours_sin[:, None]  # [B, 1, S, D] over the heads
    assert ours_cos.dtype == torch.float32
    assert torch.equal(apply_rope(q, ours_cos, ours_sin, paired=True), want_q)
    assert torch.equal(apply_rope(k, ours_cos, ours_sin, paired=True), want_k)
    assert not torch.equal(apply_rope(q, ours_cos, ours_sin), want_q)  # Llama's halves would differ
