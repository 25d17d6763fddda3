"""bench/peer_modelopt/convert.py: a Model-Optimizer DFlash export, converted to our checkpoint,
computes what the peer's own code computed (tests/fixtures/peer_modelopt/, written by
bench/peer_modelopt/make_fixture.py with nvidia-modelopt; this test needs only our code).

Two forwards of the peer are compared, in float32 on a tiny seeded Llama target:
* inference: the peer's `pseudo_speculative_generate` (its tap selection, block
  [anchor, MASK, ...] after the prompt) against our eval's path (SpeculativeDecoder +
  DFlashProposer, as `dflash-train eval` runs them): the drafter's logits and tokens;
* training: the peer's training forward on one row with the anchors it drew, against our
  training path (TargetRunner taps, dense masks of drafter/masks.py, DFlashDrafter).
Each comparison also shows that a semantic slip (reversed taps, a causal block, another
rope theta) moves the output far beyond the tolerance, so the test can fail.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.drafter.checkpoint import load_drafter
from dflash_train.drafter.masks import build_layer_masks
from dflash_train.drafter.model import DFlashDrafter, block_input_ids, block_positions
from dflash_train.speculative.loop import DFlashProposer, SpeculativeDecoder
from dflash_train.target.runner import TargetRunner
from dflash_train.utils.errors import ModelError

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "peer_modelopt"
TOL = dict(rtol=1e-5, atol=2e-5)


def _convert_module():
    spec = importlib.util.spec_from_file_location("peer_convert", ROOT / "bench" / "peer_modelopt" / "convert.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peer():
    from transformers import LlamaForCausalLM

    target = LlamaForCausalLM.from_pretrained(str(FIXTURE / "target"), dtype=torch.float32).eval()
    return target, load_file(str(FIXTURE / "io.safetensors"))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("converted") / "drafter"
    _convert_module().convert(FIXTURE / "export", out, dtype=torch.float32)
    return load_drafter(out)


def _with_config(drafter: DFlashDrafter, **changes) -> DFlashDrafter:
    mutated = DFlashDrafter(dataclasses.replace(drafter.config, **changes))
    mutated.load_state_dict(drafter.state_dict())
    return mutated.eval()


def _draft_logits(target, drafter: DFlashDrafter, prompt: list[int]) -> tuple[int, torch.Tensor]:
    """Our eval's first proposal after prefilling `prompt`: (first token, logits of slots 1..B-1)."""
    lm_head = target.get_output_embeddings().weight
    seen = {}

    class Probe(DFlashProposer):
        def propose(self, sequence, position):
            if "first" not in seen:  # the first round: the block right after the prefill
                seen["logits"] = self.block_hidden(sequence[-1], position)[1:] @ lm_head.T
                seen["first"] = sequence[-1]
            return super().propose(sequence, position)

    with SpeculativeDecoder(target, drafter.config.target_layer_ids, stop_token_ids=[]) as decoder:
        decoder.generate(prompt, max_new_tokens=drafter.config.block_size + 1, proposer=Probe(drafter, target.get_input_embeddings().weight,
                                                                   lm_head))
    return seen["first"], seen["logits"]


def test_inference_matches_the_peers_drafter(peer, converted):
    target, io = peer
    prompt = io["prompt_ids"][0].tolist()
    first, logits = _draft_logits(target, converted, prompt)
    assert first == int(io["base_token"])
    torch.testing.assert_close(logits, io["draft_logits"][0], **TOL)
    assert logits.argmax(-1).tolist() == io["draft_tokens"][0].tolist()
    # the same comparison fails for a drafter that reads its taps in reverse or is causal in the block
    flipped = _with_config(converted, target_layer_ids=converted.config.target_layer_ids[::-1])
    flipped.fc.weight.data = converted.fc.weight.data  # same weights, taps concatenated the other way
    for wrong in (flipped, _with_config(converted, causal_in_block_full=True),
                  _with_config(converted, rope_theta=10000.0)):
        assert (_draft_logits(target, wrong, prompt)[1] - io["draft_logits"][0]).abs().max() > 1e-2


def _train_hidden(target, drafter: DFlashDrafter, io: dict) -> torch.Tensor:
    ids, anchors = io["train_ids"], io["train_anchors"]
    cfg = drafter.config
    positions = torch.arange(ids.shape[1])[None]
    documents = torch.zeros_like(ids)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        runner = TargetRunner(target, cfg.target_layer_ids)
        taps = runner(ids, positions, documents).taps
        runner.close()
        masks = build_layer_masks(cfg, documents, positions, anchors, valid, backend="dense")
        embeds = target.get_input_embeddings()(block_input_ids(ids, anchors, cfg.block_size, cfg.mask_token_id))
        return drafter(taps, positions, embeds, block_positions(positions, anchors, cfg.block_size), masks)


def test_training_forward_matches_the_peers(peer, converted):
    target, io = peer
    assert io["train_anchors"].shape == (1, 4)
    hidden = _train_hidden(target, converted, io)
    torch.testing.assert_close(hidden, io["train_hidden"], **TOL)
    for wrong in (_with_config(converted, causal_in_block_full=True), _with_config(converted, rope_theta=10000.0)):
        assert (_train_hidden(target, wrong, io) - io["train_hidden"]).abs().max() > 1e-2


def test_converted_config_keeps_the_peers_settings(converted):
    meta = json.loads((FIXTURE / "meta.json").read_text())
    cfg = converted.config
    assert cfg.target_layer_ids == meta["target_layer_ids"] and cfg.block_size == meta["block_size"]
    assert cfg.mask_token_id == meta["mask_token_id"] and cfg.rope_theta == meta["draft_rope_theta"]
    assert cfg.rms_norm_eps == 1e-5 and not cfg.causal_in_block_full and cfg.layer_types == ["full_attention"] * 5


@pytest.mark.parametrize("change, needle", [
    ({"dflash_config": {"mask_token_id": 63, "target_layer_ids": [1, 2, 3, 4, 5], "attention_sink_bias": True}},
     "attention sinks"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"architectures": ["Qwen3ForCausalLM"]}, "DFlashDraftModel"),
])
def test_unsupported_exports_are_refused(tmp_path, change, needle):
    peer_dir = tmp_path / "export"
    peer_dir.mkdir()
    cfg = {**json.loads((FIXTURE / "export" / "config.json").read_text()), **change}
    (peer_dir / "config.json").write_text(json.dumps(cfg))
    (peer_dir / "model.safetensors").write_bytes((FIXTURE / "export" / "model.safetensors").read_bytes())
    with pytest.raises(ModelError, match=needle):
        _convert_module().convert(peer_dir, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_rope_theta_other_than_the_trained_one_is_refused(tmp_path):
    peer_dir = tmp_path / "export"
    peer_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        (peer_dir / name).write_bytes((FIXTURE / "export" / name).read_bytes())
    (peer_dir / "peer_run.json").write_text(json.dumps({"draft_rope_theta": 10000.0}))
    with pytest.raises(ModelError, match="rope_theta"):
        _convert_module().convert(peer_dir, tmp_path / "out")
