import json

import pytest
import torch
from safetensors import safe_open

from dflash_train.drafter.checkpoint import load_drafter, save_drafter
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.utils.errors import ModelError
from dflash_train.utils.fs import atomic_directory_write

from .test_model import tiny_config

SPEC_LAYER_TENSORS = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
]


def test_round_trip_and_spec_layout(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = DFlashDrafter(cfg)
    out = save_drafter(model, tmp_path / "drafter", dtype=torch.float32)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    data = json.loads((out / "config.json").read_text())
    assert data["architectures"] == ["DFlashDraftModel"] and data["model_type"] == "qwen3"
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings",
                "layer_types", "sliding_window", "block_size", "num_target_layers"):
        assert key in data, key
    assert data["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert data["dflash_config"]["mask_token_id"] == cfg.mask_token_id
    assert data["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids
    assert data["num_target_layers"] == 5 and data["block_size"] == 4
    want = {f"layers.{i}.{t}" for i in range(cfg.num_hidden_layers) for t in SPEC_LAYER_TENSORS}
    want |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == want
    loaded = load_drafter(out)
    assert loaded.config == model.config
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_bf16_default_and_load_errors(tmp_path):
    model = DFlashDrafter(tiny_config())
    out = save_drafter(model, tmp_path / "d")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16
    (out / "model.safetensors").unlink()
    with pytest.raises(ModelError, match="model.safetensors"):
        load_drafter(out)
    (out / "model.safetensors").write_bytes(b"\x00" * 10)  # truncated
    with pytest.raises(ModelError, match="cannot read the weights"):
        load_drafter(out)
    (out / "config.json").write_text("{")
    with pytest.raises(ModelError, match="config.json: not valid JSON"):
        load_drafter(out)


def test_atomic_write_keeps_the_old_version_on_failure(tmp_path):
    target = tmp_path / "ckpt"
    atomic_directory_write(target, lambda d: (d / "a.txt").write_text("old"))

    def failing(d):
        (d / "a.txt").write_text("new, half written")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_directory_write(target, failing)
    assert (target / "a.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temporary left behind
    atomic_directory_write(target, lambda d: (d / "a.txt").write_text("new"))
    assert (target / "a.txt").read_text() == "new"


def _edit_config(directory, **changes):
    data = json.loads((directory / "config.json").read_text())
    for dotted, value in changes.items():
        node, *path = dotted.split("__")
        (data[node] if path else data).__setitem__(path[0] if path else node, value)
    (directory / "config.json").write_text(json.dumps(data))


@pytest.mark.parametrize("changes, problem", [
    ({"intermediate_size": 48}, "layers.0.mlp.gate_proj.weight is [24, 16] there, config.json makes it [48, 16]"),
    ({"dflash_config__target_layer_ids": [0, 1, 2, 3]}, "fc.weight is [16, 48] there, config.json makes it [16, 64]"),
    ({"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3},
     "layers.2.self_attn.q_proj.weight is missing there"),
    ({"num_hidden_layers": 1, "layer_types": ["full_attention"]},
     "layers.1.input_layernorm.weight is there, config.json has no such tensor"),
    ({"hidden_size": 4096}, "layers.0.self_attn.q_proj.weight is [32, 16] there, config.json makes it [32, 4096]"),
    ({"hidden_size": 2_000_000_000}, "config.json: describes no drafter this version builds (Storage size"),
    ({"rope_scaling": True}, "config.json: describes no drafter this version builds"),
])
def test_a_config_that_does_not_describe_the_weights_is_named_before_anything_is_allocated(tmp_path, changes,
                                                                                              problem):
    out = save_drafter(DFlashDrafter(tiny_config()), tmp_path / "d")
    _edit_config(out, **changes)
    with pytest.raises(ModelError) as exc:
        load_drafter(out)
    assert problem in str(exc.value)
    if "there" in problem:
        assert str(exc.value).startswith(f"{out}: config.json does not describe model.safetensors: ")
        assert str(exc.value).endswith("use the config.json exported with these weights")
