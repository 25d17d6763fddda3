"""Projections of one input as one matmul (target/projections.py fused_projection): q, k and v, an MLP's
gate and up. The linears then view the fused tensor: the model's own forward reads the same values and
no second copy of the weights is kept."""

import pytest
import torch
from torch import nn

from dflash_train.target.fp8 import convert_decoder_linears
from dflash_train.target.language_model import attention_projections, mlp_projections
from dflash_train.target.packed import PackedForward
from dflash_train.target.presets import build_random_target
from dflash_train.target.projections import (
    fused_or_each,
    fused_projection,
    gated_mlp,
    project,
    project_fused,
    projection_of,
)
from dflash_train.target.runner import find_decoder_layers


def _tiny():
    return build_random_target("preset:tiny", dtype=torch.float32, device="cpu", seed=3)  # frozen, Qwen3 blocks


def _linears(out_features, bias, seed=0, requires_grad=False):
    torch.manual_seed(seed)
    mods = [nn.Linear(16, n, bias=bias) for n in out_features]
    for m in mods:
        m.requires_grad_(requires_grad)
    return mods


def test_q_k_v_become_one_tensor_that_the_linears_view_and_the_model_reads_the_same():
    model = _tiny()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        before = model(ids).logits
    attn = model.model.layers[0].self_attn
    old = [m.weight.detach().clone() for m, _ in attention_projections(attn)]
    fused, k_p, v_p = fused_or_each(attention_projections(attn))
    assert k_p is None and v_p is None
    assert torch.equal(fused[0], torch.cat(old)) and fused[1] is None
    start = 0
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):  # each linear views its rows: no second copy
        assert m.weight.untyped_storage().data_ptr() == fused[0].untyped_storage().data_ptr()
        assert m.weight.storage_offset() == start * fused[0].shape[1] and not m.weight.requires_grad
        start += m.out_features
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    again = fused_projection(attention_projections(attn))  # fused before: the same tensor, not a copy
    assert again[0].data_ptr() == fused[0].data_ptr() and again[0].shape == fused[0].shape


def test_biases_are_fused_too_and_one_matmul_equals_each():
    mods = _linears([24, 8, 8], bias=True)
    h = torch.randn(3, 5, 16)
    each = project(h, [projection_of(m) for m in mods])
    fused = fused_or_each([(m, None) for m in mods])
    assert fused[1:] == (None, None) and fused[0][1].shape == (40,)
    got = project_fused(h, fused, (24, 8, 8))
    for a, b in zip(got, each):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert [t.shape[-1] for t in got] == [24, 8, 8]


def test_a_fused_gate_and_up_give_the_same_mlp():
    gate, up = _linears([32, 32], bias=False, seed=1)
    down = nn.Linear(32, 16, bias=False).requires_grad_(False)
    h = torch.randn(4, 16)
    each = gated_mlp(h, projection_of(gate), projection_of(up), projection_of(down))
    gate_up, none = fused_or_each([(gate, None), (up, None)])
    assert none is None
    torch.testing.assert_close(gated_mlp(h, gate_up, None, projection_of(down)), each, rtol=0, atol=1e-6)


@pytest.mark.parametrize("why", ["training", "mixed biases", "mixed dtypes"])
def test_projections_that_cannot_be_one_stay_apart_and_untouched(why):
    mods = _linears([24, 8, 8], bias=True, requires_grad=why == "training")
    if why == "mixed biases":
        mods[1] = nn.Linear(16, 8, bias=False).requires_grad_(False)
    if why == "mixed dtypes":
        mods[2] = mods[2].to(torch.float64)
    weights = [m.weight for m in mods]
    assert fused_projection([(m, None) for m in mods]) is None
    each = fused_or_each([(m, None) for m in mods])
    assert all(p is not None for p in each) and all(m.weight is w for m, w in zip(mods, weights))


def test_a_fused_module_gives_its_own_weights_and_float8_stays_apart():
    phi3_like = nn.Linear(16, 40, bias=False).requires_grad_(False)  # q 24 rows, k 8, v 8 (Phi-3's qkv_proj)
    rows = [(phi3_like, slice(0, 24)), (phi3_like, slice(24, 32)), (phi3_like, slice(32, 40))]
    assert fused_projection(rows)[0] is phi3_like.weight
    assert fused_projection(rows[:2]) is None  # not the whole module: its row blocks apart
    model = _tiny()
    convert_decoder_linears(model, find_decoder_layers(model))
    attn = model.model.layers[0].self_attn
    assert fused_projection(attention_projections(attn)) is None
    assert fused_projection(mlp_projections(model.model.layers[0].mlp)) is None


def test_the_packed_forward_runs_q_k_v_and_gate_up_as_one_projection_each():
    model = _tiny()
    packed = PackedForward(model, [1, 2])
    for lay, layer in zip(packed.layers, model.model.layers):
        _, qkv, k_p, v_p, *_ = lay.pre
        assert k_p is None and v_p is None and qkv[0].shape[0] == sum(
            m.out_features for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj))
        _, _, gate_up, up, _ = lay.post
        assert up is None and gate_up[0].shape[0] == 2 * layer.mlp.up_proj.out_features


def test_one_projection_is_itself_rows_and_all():
    qkv = nn.Linear(16, 40, bias=True).requires_grad_(False)
    weight, bias = fused_projection([(qkv, slice(8, 24))])
    assert torch.equal(weight, qkv.weight[8:24]) and torch.equal(bias, qkv.bias[8:24])
