"""drafter.init_from_target: which target layers, and the tensor mapping (Llama, Qwen2, Qwen3, fused Phi-3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_train.drafter.config import DrafterSpec, drafter_config_from_target, init_source_layers, spread_layer_ids
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.drafter.target_init import check_target_layers_copyable, copy_target_layers


def test_which_target_layers():
    # SmolLM2-135M: 30 layers, 5 drafter layers
    assert init_source_layers(DrafterSpec(init_from_target="last"), 30) == [25, 26, 27, 28, 29]
    assert init_source_layers(DrafterSpec(init_from_target="spread"), 30) == [3, 9, 15, 21, 27]
    assert init_source_layers(DrafterSpec(num_layers=1, init_from_target="spread"), 30) == [15]
    assert init_source_layers(DrafterSpec(num_layers=3, init_from_target="last"), 30) == [27, 28, 29]
    assert init_source_layers(DrafterSpec(num_layers=2, init_from_target="layers", init_target_layers=[7, 7]), 30) == [7, 7]
    assert init_source_layers(DrafterSpec(), 30) is None
    for L in range(1, 40):
        for n in range(1, L + 1):
            ids = spread_layer_ids(L, n)
            assert len(ids) == n and ids == sorted(set(ids)) and 0 <= ids[0] and ids[-1] < L
    with pytest.raises(ValueError, match="6 drafter layers, but the target has only 5"):
        init_source_layers(DrafterSpec(num_layers=6, init_from_target="last"), 5)
    with pytest.raises(ValueError, match=r"init_target_layers \[30\] are outside the target's decoder layers 0..29"):
        init_source_layers(DrafterSpec(num_layers=1, init_from_target="layers", init_target_layers=[30]), 30)


@pytest.mark.parametrize("kw, msg", [
    (dict(init_from_target="layers"), "needs drafter.init_target_layers with one target layer id per drafter layer"),
    (dict(init_from_target="layers", init_target_layers=[1, 2]), r"per drafter layer \(5\), got 2"),
    (dict(num_layers=1, init_from_target="layers", init_target_layers=[-1]), "must be >= 0"),
    (dict(init_target_layers=[1, 2, 3, 4, 5]), "applies to drafter.init_from_target layers"),
    (dict(init_from_target="last", init_from="drafters/x"), "choose one"),
])
def test_spec_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DrafterSpec(**kw)


def _drafter_for(hf_config, layers: int = 2) -> DFlashDrafter:
    return DFlashDrafter(drafter_config_from_target(hf_config, mask_token_id=0, num_hidden_layers=layers, num_taps=2))


def _layer_state(model, i):
    return {k: v.detach().clone() for k, v in model.model.layers[i].state_dict().items()}


def _randomize_norms(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def test_llama_layers_copy_and_qk_norms_stay_one():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, pad_token_id=0)
    target = LlamaForCausalLM(cfg)
    _randomize_norms(target)
    drafter = _drafter_for(cfg)
    report = copy_target_layers(drafter, [3, 1], {3: _layer_state(target, 3), 1: _layer_state(target, 1)})
    sd = target.state_dict()
    for i, j in enumerate([3, 1]):
        layer = drafter.layers[i]
        for ours, theirs in [(layer.self_attn.q_proj, "self_attn.q_proj"), (layer.self_attn.k_proj, "self_attn.k_proj"),
                             (layer.self_attn.v_proj, "self_attn.v_proj"), (layer.self_attn.o_proj, "self_attn.o_proj"),
                             (layer.mlp.gate_proj, "mlp.gate_proj"), (layer.mlp.up_proj, "mlp.up_proj"),
                             (layer.mlp.down_proj, "mlp.down_proj"), (layer.input_layernorm, "input_layernorm"),
                             (layer.post_attention_layernorm, "post_attention_layernorm")]:
            assert torch.equal(ours.weight, sd[f"model.layers.{j}.{theirs}.weight"]), (i, theirs)
        assert torch.equal(layer.self_attn.q_norm.weight, torch.ones(8))  # Llama has none: kept
        assert torch.equal(layer.self_attn.k_norm.weight, torch.ones(8))
    assert report.kept == ["self_attn.k_norm.weight", "self_attn.q_norm.weight"] and report.left_out == []


def test_phi3_fused_projections_are_split():
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    cfg = Phi3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=1)
    target = Phi3ForCausalLM(cfg)
    drafter = _drafter_for(cfg, layers=1)
    copy_target_layers(drafter, [1], {1: _layer_state(target, 1)})
    qkv = target.model.layers[1].self_attn.qkv_proj.weight  # rows: 4 q heads, 2 k heads, 2 v heads of 8
    gate_up = target.model.layers[1].mlp.gate_up_proj.weight  # rows: 48 gate, 48 up
    a, m = drafter.layers[0].self_attn, drafter.layers[0].mlp
    assert torch.equal(a.q_proj.weight, qkv[0:32]) and torch.equal(a.k_proj.weight, qkv[32:48])
    assert torch.equal(a.v_proj.weight, qkv[48:64])
    assert torch.equal(m.gate_proj.weight, gate_up[0:48]) and torch.equal(m.up_proj.weight, gate_up[48:96])
    # the split is the one Phi-3 computes with: same MLP output
    x = torch.randn(3, 32)
    with torch.no_grad():
        assert torch.allclose(m(x), target.model.layers[1].mlp(x), atol=1e-6)


def test_qwen2_biases_are_reported_not_copied():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    target = Qwen2ForCausalLM(cfg)
    report = copy_target_layers(_drafter_for(cfg, layers=1), [0], {0: _layer_state(target, 0)})
    assert report.left_out == ["self_attn.k_proj.bias", "self_attn.q_proj.bias", "self_attn.v_proj.bias"]


@pytest.mark.parametrize("name", ["smollm3", "seed_oss"])
def test_smollm3_and_seed_oss_layers_copy_their_weights_and_report_biases(name):
    from tests.families import build_model

    target = build_model(name, 64)
    check_target_layers_copyable(target.config)
    drafter = _drafter_for(target.config, layers=1)
    report = copy_target_layers(drafter, [1], {1: _layer_state(target, 1)})
    theirs = target.model.layers[1]
    for module in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                   "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
        assert torch.equal(drafter.layers[0].get_submodule(module).weight, theirs.get_submodule(module).weight)
    biases = ["self_attn.k_proj.bias", "self_attn.o_proj.bias", "self_attn.q_proj.bias", "self_attn.v_proj.bias"]
    assert report.left_out == (biases if name == "seed_oss" else [])


def test_shape_mismatch_names_the_tensor_and_writes_nothing():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, vocab_size=64)
    target = Qwen3ForCausalLM(cfg)
    drafter = DFlashDrafter(drafter_config_from_target(cfg, mask_token_id=0, num_hidden_layers=2, num_taps=2,
                                                       intermediate_size=40))
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    with pytest.raises(ValueError, match=r"drafter layer 0 <- target layer 1: tensor mlp.gate_proj.weight has "
                                         r"shape \[48, 32\] in the target, \[40, 32\] in the drafter"):
        copy_target_layers(drafter, [1, 0], {0: _layer_state(target, 0), 1: _layer_state(target, 1)})
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in before.items())
    state = _layer_state(target, 0)
    del state["self_attn.o_proj.weight"]
    with pytest.raises(ValueError, match="no tensor for the drafter's self_attn.o_proj.weight"):
        copy_target_layers(_drafter_for(cfg, layers=1), [0], {0: state})


def test_only_layer_structures_like_the_drafters_are_copied():
    check_target_layers_copyable(SimpleNamespace(model_type="qwen3", hidden_act="silu"))
    with pytest.raises(ValueError, match="not 'gemma3_text'"):
        check_target_layers_copyable(SimpleNamespace(model_type="gemma3_text", hidden_act="gelu_pytorch_tanh"))
    with pytest.raises(ValueError, match="activation is 'gelu'"):
        check_target_layers_copyable(SimpleNamespace(model_type="llama", hidden_act="gelu"))
