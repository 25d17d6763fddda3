"""The language model inside every family's target (tests/families.py), multimodal wrappers whose
vision tower is as deep as the text stack included: the decoder layers tapped, the final norm, the
text config, the layer tensors and the embedding / LM head read from the files."""

from __future__ import annotations

import pytest
import torch

from dflash_train.drafter.config import DrafterSpec, build_drafter_config, mismatches_with_target
from dflash_train.target.language_model import (final_logit_scale, final_logit_softcap, find_decoder_layers,
                                                find_final_norm, language_model, text_config)
from dflash_train.target.loading import load_decoder_layer_tensors, load_frozen_head_weights, text_tensor_key
from dflash_train.target.runner import TargetRunner
from tests.families import FAMILIES, LAYERS, build_model

from ..family_dirs import save_tiny_family

VOCAB = 300
CPU = torch.device("cpu")


def qwen3_5_wrapper(vocab: int = VOCAB):
    """Qwen3.5 as its multimodal checkpoints load it (Qwen3_5ForConditionalGeneration), the vision
    tower's block list as long as the text stack."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = FAMILIES["qwen3_5"].config(vocab)
    vision = dict(depth=LAYERS, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    torch.manual_seed(0)
    return Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision)).eval()


@pytest.fixture(scope="module")
def gemma3():
    return build_model("gemma3", VOCAB)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_layers_and_final_norm_are_the_language_models(name):
    model = build_model(name, VOCAB)
    text_model = model.model.language_model if FAMILIES[name].multimodal else model.model  # written out by hand
    assert find_decoder_layers(model) is text_model.layers
    assert language_model(model) is text_model
    # the final norm is the one whose output gives the logits through the LM head (whatever its name)
    norm, seen = find_final_norm(model), []
    handle = norm.register_forward_hook(lambda module, args, output: seen.append(output))
    with torch.no_grad():
        logits = model(torch.arange(3, 15)[None]).logits
    handle.remove()
    assert norm in list(text_model.children()) and len(seen) == 1
    cap, scale = final_logit_softcap(model.config), final_logit_scale(model.config)
    scaled = model.get_output_embeddings()(seen[0]) * scale
    expected = scaled if cap is None else cap * torch.tanh(scaled / cap)
    torch.testing.assert_close(expected, logits, rtol=0, atol=1e-5)


def test_a_vision_tower_as_deep_as_the_text_stack_is_never_taken(gemma3):
    vision_lists = [m for m in gemma3.model.vision_tower.modules() if isinstance(m, torch.nn.ModuleList)]
    assert [len(m) for m in vision_lists] == [LAYERS]  # the trap is set: a list of as many blocks as the text's
    names = [n for n, m in gemma3.named_modules() if isinstance(m, torch.nn.ModuleList)]
    assert "vision" in names[0]  # ... and it comes first
    assert find_decoder_layers(gemma3) is gemma3.model.language_model.layers
    qwen = qwen3_5_wrapper()
    assert len(qwen.model.visual.blocks) == LAYERS
    assert find_decoder_layers(qwen) is qwen.model.language_model.layers
    assert find_final_norm(qwen) is qwen.model.language_model.norm


def test_wrapper_taps_equal_the_language_models_hidden_states(gemma3):
    """hidden_states[l + 1] is layer l's output (the last entry is after the final norm, so the taps
    stop a layer short of it); the final state through the LM head gives the model's own logits."""
    gen = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, VOCAB - 8, (n,), generator=gen) for n in (13, 9)]
    with torch.no_grad():
        refs = [gemma3(input_ids=d[None], output_hidden_states=True) for d in docs]
    runner = TargetRunner(gemma3, [0, 1, 2], need_final=True)
    try:
        batch = torch.zeros(2, 13, dtype=torch.long)
        for i, d in enumerate(docs):
            batch[i, :len(d)] = d
        taps, final = runner.run_documents(batch, torch.tensor([13, 9]))
    finally:
        runner.close()
    for i, (d, ref) in enumerate(zip(docs, refs)):
        n = len(d)
        for j, layer in enumerate((0, 1, 2)):
            torch.testing.assert_close(taps[j][i, :n], ref.hidden_states[layer + 1][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(final[i, :n] @ gemma3.lm_head.weight.T, ref.logits[0], rtol=0, atol=1e-4)


def test_text_config_of_a_wrapper_sizes_the_drafter(gemma3):
    cfg = gemma3.config
    assert text_config(cfg) is cfg.text_config
    drafter = build_drafter_config(DrafterSpec(num_layers=1, block_size=4), cfg, mask_token_id=VOCAB - 8)
    assert (drafter.hidden_size, drafter.num_target_layers, drafter.vocab_size, drafter.head_dim) == (64, 4, VOCAB, 16)
    assert (drafter.num_attention_heads, drafter.num_key_value_heads) == (4, 2)
    assert mismatches_with_target(drafter, cfg) == []
    assert final_logit_softcap(cfg) is None
    assert final_logit_softcap(FAMILIES["gemma2"].config(VOCAB)) == 30.0


@pytest.mark.parametrize("name", ["gemma3", "qwen3_5_wrapper"])
def test_layer_tensors_and_heads_from_the_files_are_the_language_models(name, tmp_path):
    if name == "gemma3":
        model, _ = save_tiny_family("gemma3", tmp_path)
    else:
        from tests.conftest import build_tokenizer

        build_tokenizer(tmp_path)
        model = qwen3_5_wrapper()
        model.save_pretrained(str(tmp_path), safe_serialization=True)
    layers = find_decoder_layers(model)
    found = load_decoder_layer_tensors(str(tmp_path), [0, 3], dtype=torch.float32, device=CPU)  # from the files
    for i in (0, 3):
        expected = layers[i].state_dict()
        assert sorted(found[i]) == sorted(expected)
        for key, value in expected.items():
            assert torch.equal(found[i][key], value), key
    embed, head = load_frozen_head_weights(str(tmp_path), dtype=torch.float32)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)


def test_text_tensor_key_takes_the_language_models_own_tensor():
    names = ["model.layers.61.embed_tokens.weight", "model.embed_tokens.weight", "model.visual.pos_embed.weight"]
    assert text_tensor_key(names, "embed_tokens.weight") == "model.embed_tokens.weight"
    names = ["language_model.model.embed_tokens.weight", "vision_tower.embeddings.patch_embedding.weight"]
    assert text_tensor_key(names, "embed_tokens.weight") == "language_model.model.embed_tokens.weight"
    assert text_tensor_key(["language_model.lm_head.weight", "mtp.0.lm_head.weight.x"], "lm_head.weight") == \
        "language_model.lm_head.weight"
    assert text_tensor_key(["model.norm.weight"], "lm_head.weight") is None
