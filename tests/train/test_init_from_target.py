"""drafter.init_from_target in a training run: the drafter's layers start as exact copies of the chosen
target layers (a random `preset:tiny` target and saved Hugging Face ones), from the loaded target or
from its files; a shape mismatch is a clear error; --resume loads its checkpoint and copies nothing."""

from __future__ import annotations

import pytest
import torch

import dflash_train.train.setup as setup_mod
from dflash_train.drafter.checkpoint import load_drafter
from dflash_train.target.fp8 import convert_decoder_linears
from dflash_train.target.loading import load_causal_lm, load_decoder_layer_tensors, open_target
from dflash_train.target.runner import find_decoder_layers
from dflash_train.train.checkpoint import latest_checkpoint
from dflash_train.train.config import TrainConfig
from dflash_train.train.trainer import Trainer
from dflash_train.utils.config import load_config
from dflash_train.utils.errors import ConfigError

from ..conftest import ON_CPU
from .test_trainer import make_config

CPU = torch.device("cpu")

# Written out by hand, independently of the code under test: each drafter layer tensor and the
# full name of the target parameter ({j} = the target layer) it must equal after the copy.
EXPECTED_SOURCE = {
    "self_attn.q_proj.weight": "model.layers.{j}.self_attn.q_proj.weight",
    "self_attn.k_proj.weight": "model.layers.{j}.self_attn.k_proj.weight",
    "self_attn.v_proj.weight": "model.layers.{j}.self_attn.v_proj.weight",
    "self_attn.o_proj.weight": "model.layers.{j}.self_attn.o_proj.weight",
    "self_attn.q_norm.weight": "model.layers.{j}.self_attn.q_norm.weight",
    "self_attn.k_norm.weight": "model.layers.{j}.self_attn.k_norm.weight",
    "mlp.gate_proj.weight": "model.layers.{j}.mlp.gate_proj.weight",
    "mlp.up_proj.weight": "model.layers.{j}.mlp.up_proj.weight",
    "mlp.down_proj.weight": "model.layers.{j}.mlp.down_proj.weight",
    "input_layernorm.weight": "model.layers.{j}.input_layernorm.weight",
    "post_attention_layernorm.weight": "model.layers.{j}.post_attention_layernorm.weight",
}


def preset_config(**overrides) -> TrainConfig:
    base = {"target.path": "preset:tiny", "data.path": "unused", "drafter.num_layers": 2, "drafter.block_size": 4,
            **ON_CPU}
    base.update(overrides)
    return load_config(TrainConfig, None, {k: str(v) for k, v in base.items()})


def build(cfg: TrainConfig, perturb_norms: bool = True):
    """(frozen target, drafter) as a fresh run builds them, the target's norms made non-trivial first."""
    target_config, _ = open_target(cfg.target.path)
    d = setup_mod.resolve_drafter_config(cfg, target_config, None)
    init = setup_mod.resolve_init_layers(cfg, target_config)
    torch.manual_seed(0)
    target = setup_mod.load_frozen_target(cfg, d, CPU, whole_model=True)
    if perturb_norms:  # the preset's norms are all 1: give them values a copy can be told apart by
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in target.model.named_parameters():
                if "norm" in name:
                    p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
    torch.manual_seed(0)
    drafter = setup_mod.build_drafter(cfg, d, target.heads, CPU, init_layers=init, target_model=target.model)
    return target, drafter, init


@pytest.mark.parametrize("mode, extra, expected", [
    ("last", {}, [4, 5]),  # preset:tiny has 6 layers
    ("spread", {}, [1, 4]),
    ("layers", {"drafter.init_target_layers": "5,0"}, [5, 0]),
])
def test_drafter_layers_equal_the_chosen_target_layers(mode, extra, expected):
    cfg = preset_config(**{"drafter.init_from_target": mode, **extra})
    target, drafter, init = build(cfg)
    assert init == expected
    target_params = dict(target.model.named_parameters())
    for i, j in enumerate(expected):
        layer = dict(drafter.layers[i].named_parameters())
        assert sorted(layer) == sorted(EXPECTED_SOURCE)  # every tensor of the layer is checked
        for name, param in layer.items():
            src = target_params[EXPECTED_SOURCE[name].format(j=j)]
            assert torch.equal(param, src), (i, name)
            assert param.data_ptr() != src.data_ptr()  # a copy: training never touches the target
    # the rest is the random start of a run without the option (same seed)
    _, plain, none = build(preset_config())
    assert none is None
    for name in ("fc.weight", "hidden_norm.weight", "norm.weight"):
        assert torch.equal(drafter.state_dict()[name], plain.state_dict()[name]), name
    assert not torch.equal(plain.layers[0].self_attn.q_proj.weight, drafter.layers[0].self_attn.q_proj.weight)


def test_without_the_loaded_target_the_same_weights_come_from_the_preset():
    """A split layout's drafter rank holds no target: it builds the same seeded preset."""
    cfg = preset_config(**{"drafter.init_from_target": "spread"})
    _, from_model, _ = build(cfg, perturb_norms=False)
    target_config, _ = open_target(cfg.target.path)
    d = setup_mod.resolve_drafter_config(cfg, target_config, None)
    torch.manual_seed(0)
    heads = setup_mod.load_frozen_target(cfg, d, CPU, whole_model=False).heads
    torch.manual_seed(0)
    from_files = setup_mod.build_drafter(cfg, d, heads, CPU, init_layers=[1, 4], target_model=None)
    for (name, a), b in zip(from_model.layers.state_dict().items(), from_files.layers.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_layer_tensors_from_safetensors_and_fp8_targets_equal_the_loaded_model(kind, tiny_targets):
    model = load_causal_lm(tiny_targets[kind], dtype=torch.float32)
    expected = {j: find_decoder_layers(model)[j].state_dict() for j in (1, 4)}
    from_files = load_decoder_layer_tensors(str(tiny_targets[kind]), [4, 1], dtype=torch.float32, device=CPU)
    convert_decoder_linears(model, find_decoder_layers(model))  # the FP8 target has lost its linears' weights
    from_fp8 = load_decoder_layer_tensors(str(tiny_targets[kind]), [1, 4], dtype=torch.float32, device=CPU, model=model)
    for got in (from_files, from_fp8):
        assert sorted(got) == [1, 4]
        for j in (1, 4):
            assert sorted(got[j]) == sorted(expected[j])
            for name, t in expected[j].items():
                assert torch.equal(got[j][name], t), (j, name)
    bf16 = load_decoder_layer_tensors(str(tiny_targets[kind]), [1], dtype=torch.bfloat16, device=CPU)
    assert torch.equal(bf16[1]["mlp.up_proj.weight"], expected[1]["mlp.up_proj.weight"].to(torch.bfloat16))


def test_a_shape_mismatch_is_an_error_naming_the_tensor():
    cfg = preset_config(**{"drafter.init_from_target": "last", "drafter.intermediate_size": 96})
    with pytest.raises(ConfigError, match=r"drafter.init_from_target=last: drafter layer 0 <- target layer 4: tensor "
                                          r"mlp.gate_proj.weight has shape \[128, 64\] in the target, \[96, 64\] in "
                                          r"the drafter"):
        build(cfg)


def test_too_many_layers_fail_before_the_target_loads(tiny_targets, tiny_datasets, tmp_path, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the target model was loaded before the config was validated")

    monkeypatch.setattr(setup_mod, "load_target_model", refuse)
    monkeypatch.setattr(setup_mod, "load_target_heads", refuse)
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "r",
                      **{"drafter.init_from_target": "last", "drafter.num_layers": 7})
    with pytest.raises(ConfigError, match="init_from_target=last on the target .*: 7 drafter layers, but the target "
                                          "has only 6"):
        Trainer(cfg)


def test_a_fresh_run_copies_and_resume_loads_its_checkpoint_without_copying(tiny_targets, tiny_datasets, tmp_path,
                                                                          monkeypatch):
    calls = []
    real = setup_mod.load_decoder_layer_tensors

    def spy(*args, **kwargs):
        calls.append(args[1])
        return real(*args, **kwargs)

    monkeypatch.setattr(setup_mod, "load_decoder_layer_tensors", spy)
    out = tmp_path / "run"
    opts = {"drafter.init_from_target": "last", "run.save_every": 4}
    fresh = Trainer(make_config(tiny_targets["qwen3"], tiny_datasets["qwen3"], out, **opts, **{"run.max_steps": 4}))
    assert calls == [[4, 5]]
    target_layers = find_decoder_layers(fresh.target.model)
    for i, j in enumerate([4, 5]):
        for name, p in fresh.drafter.layers[i].state_dict().items():
            assert torch.equal(p, target_layers[j].state_dict()[name]), (i, name)
    fresh.fit()
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt is not None and ckpt.name.endswith("4")
    saved = load_drafter(ckpt / "drafter").state_dict()

    resumed = Trainer(make_config(tiny_targets["qwen3"], tiny_datasets["qwen3"], out, **opts, **{"run.max_steps": 8}),
                      resume=True)
    assert calls == [[4, 5]]  # nothing copied again
    assert resumed.state.step == 4
    now = resumed.drafter.state_dict()
    for name, p in saved.items():
        assert torch.equal(now[name], p), name
    q = "layers.0.self_attn.q_proj.weight"
    assert not torch.equal(now[q], target_layers[4].self_attn.q_proj.weight)  # trained away from the copy
