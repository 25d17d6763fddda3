"""Checkpoints saved quantized (target/quantized.py): a block-FP8 checkpoint, as DeepSeek-V3 and
MiniMax-M2 ship theirs, loads dequantized on every path (the whole model, the embedding and LM
head alone, the layers a drafter copies), also where a GPU would let transformers keep it in FP8;
methods that stay quantized (GPTQ, AWQ, bitsandbytes) leave the fast paths from their config,
and a sharded target, which dequantizes block-FP8 rows as it reads them, refuses the others in one
line."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from dflash_train.generate.decoder import UnsupportedModelError, check_supported_config
from dflash_train.target import loading
from dflash_train.target.loading import load_decoder_layer_tensors, load_frozen_head_weights, load_target_model
from dflash_train.target.packed import UnsupportedTarget, check_packed_config
from dflash_train.target.quantized import dequantized_rows, stays_quantized
from dflash_train.target.sharded import load_sharded_target
from dflash_train.utils.errors import ModelError
from tests.families import build_model

from ..family_dirs import FP8_BLOCK, fp8_blocks, save_fp8_family

@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A Qwen3 target saved as transformers saves block-FP8 checkpoints; and its dequantized weights."""
    directory = tmp_path_factory.mktemp("fp8-target")
    return directory, save_fp8_family("qwen3", directory)


def test_rows_of_a_block_fp8_weight_dequantize_as_the_whole_weight_does():
    """The sharded reader's rows (any range, across blocks, a weight narrower than its last block)."""
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, scale, whole = fp8_blocks(w)
    for start, stop in [(0, 300), (50, 260), (130, 131), (256, 300), (0, 1)]:
        first, last = start // FP8_BLOCK, -(-stop // FP8_BLOCK)
        got = dequantized_rows(q[start:stop], scale[first:last], start, (FP8_BLOCK, FP8_BLOCK))
        assert torch.equal(got, whole[start:stop]), (start, stop)


def test_an_fp8_checkpoint_loads_dequantized_even_where_a_gpu_would_keep_it_fp8(fp8_checkpoint, monkeypatch,
                                                                               caplog):
    directory, expected = fp8_checkpoint
    # transformers keeps a pre-quantized FP8 checkpoint in float8 layers when it sees a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with caplog.at_level(logging.INFO):
        model = load_target_model(str(directory), dtype=torch.float32, device="cpu")
    assert any("a fp8-quantized checkpoint, dequantized to float32" in r.getMessage() for r in caplog.records)
    layer = model.model.layers[1]
    assert type(layer.self_attn.q_proj) is torch.nn.Linear and layer.self_attn.q_proj.weight.dtype == torch.float32
    for name, w in model.state_dict().items():
        torch.testing.assert_close(w, expected[name], rtol=0, atol=0)
    # the packed forward and the engines take it
    check_packed_config(model.config)
    check_supported_config(model.config)


def test_heads_and_copied_layers_of_an_fp8_checkpoint_are_its_dequantized_weights(fp8_checkpoint, monkeypatch):
    """Read from the files by name (a drafter rank never loads the whole target): the heads as they
    are, the copied layers' float8 weights dequantized block by block."""
    directory, expected = fp8_checkpoint

    def no_whole_model(*args, **kwargs):
        raise AssertionError("the whole target was loaded")

    monkeypatch.setattr(loading, "load_causal_lm", no_whole_model)
    embed, head = load_frozen_head_weights(str(directory), dtype=torch.float32)
    assert torch.equal(embed, expected["model.embed_tokens.weight"]) and torch.equal(head, expected["lm_head.weight"])
    layers = load_decoder_layer_tensors(str(directory), [2], dtype=torch.float32, device="cpu")
    q = layers[2]["self_attn.q_proj.weight"]
    assert q.dtype == torch.float32 and torch.equal(q, expected["model.layers.2.self_attn.q_proj.weight"])
    assert not any(name.endswith("_scale_inv") for name in layers[2])


@pytest.mark.parametrize("method", [{"quant_method": "gptq", "bits": 4, "group_size": 128},
                                    {"quant_method": "bitsandbytes", "load_in_4bit": True}])
def test_a_method_that_stays_quantized_leaves_the_fast_paths_from_its_config(method):
    config = build_model("qwen3", 64).config
    config.quantization_config = method
    name = method["quant_method"]
    assert stays_quantized(config) == name
    with pytest.raises(UnsupportedTarget, match=f"a {name}-quantized checkpoint: the packed forward reads plain"):
        check_packed_config(config)
    with pytest.raises(UnsupportedModelError, match=f"a {name}-quantized checkpoint: the built-in engine reads"):
        check_supported_config(config)


def test_a_sharded_target_refuses_a_checkpoint_quantized_other_than_block_fp8_in_one_line(tmp_path):
    directory = tmp_path / "gptq"
    save_fp8_family("qwen3", directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError) as exc:
        load_sharded_target(str(directory), dtype=torch.float32, device=torch.device("cpu"), group=None)
    message = str(exc.value)
    assert len(message.splitlines()) == 1 and "a gptq-quantized checkpoint" in message
    assert "pipeline.target_group_size 1" in message
