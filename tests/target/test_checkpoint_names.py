"""target/checkpoint_names.py: a model tensor's names in its checkpoint, from transformers'
conversion mapping read backwards, and per-expert tensors stacked for a range of experts."""

from __future__ import annotations

import torch

from dflash_train.target.checkpoint_names import CheckpointNames


def test_renamed_modules_are_found_under_their_checkpoint_names():
    mixtral = CheckpointNames.of("mixtral")
    assert list(mixtral.names("model.layers.3.mlp.gate.weight")) == [
        "model.layers.3.mlp.gate.weight", "model.layers.3.block_sparse_moe.gate.weight"]
    gemma3 = CheckpointNames.of("gemma3")  # an anchored renaming: only at the start of a name
    assert "language_model.lm_head.weight" in list(gemma3.names("lm_head.weight"))
    assert list(gemma3.names("model.norm.lm_head")) == ["model.norm.lm_head"]
    assert list(CheckpointNames.of("llama").names("model.norm.weight")) == ["model.norm.weight"]


def test_experts_stored_one_tensor_each_are_stacked_for_a_range_of_experts():
    store = {f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight": torch.full((2, 3), 10.0 * e + i)
             for e in range(4) for i, w in enumerate(("w1", "w3", "w2"))}
    names = CheckpointNames.of("mixtral")
    gate_up = names.stacked_rows("model.layers.1.mlp.experts.gate_up_proj", range(1, 3), store.get)
    # experts 1 and 2, each gate (w1) rows then up (w3) rows: transformers' [E, 2I, H]
    assert gate_up.shape == (2, 4, 3)
    assert gate_up[:, :, 0].tolist() == [[10, 10, 11, 11], [20, 20, 21, 21]]
    down = names.stacked_rows("model.layers.1.mlp.experts.down_proj", range(3, 4), store.get)
    assert down.shape == (1, 2, 3) and float(down[0, 0, 0]) == 32
    assert names.stacked_rows("model.layers.1.mlp.experts.gate_up_proj", range(3, 5), store.get) is None  # no 4th
    assert names.stacked_rows("model.layers.1.self_attn.q_proj.weight", range(0, 1), store.get) is None
