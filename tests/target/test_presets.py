"""The benchmark presets: real shapes, checked against the published checkpoints' sizes (built on
the meta device: no memory), and the seeded random weights."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_train.target.presets import build_random_target, preset_config


def _parameters(name: str) -> tuple[int, int]:
    """(all parameters, the expert parameters) of a preset, counted on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config(f"preset:{name}"))
    return (sum(p.numel() for p in model.parameters()),
            sum(p.numel() for n, p in model.named_parameters() if ".experts." in n))


def test_llama_70b_has_the_checkpoints_parameters():
    # Llama-3.3-70B-Instruct's model.safetensors.index.json: total_size 141,107,412,992 bytes of bf16
    assert _parameters("llama3.3-70b") == (141_107_412_992 // 2, 0)


@pytest.mark.parametrize("name, total_b, active_b, experts, routed", [
    ("qwen3-235b-a22b", 235.1, 22.2, 128, 8),
    ("qwen3-30b-a3b", 30.5, 3.3, 128, 8),
    ("mixtral-8x7b", 46.7, 12.9, 8, 2),
    ("qwen3.5-35b-a3b", 34.7, 3.5, 256, 8),
])
def test_moe_presets_have_the_published_total_and_active_parameters(name, total_b, active_b, experts, routed):
    """Qwen3-235B-A22B: 235B in all, 22B active; Qwen3-30B-A3B: 30.5B and 3.3B (model cards; the
    30B's 30,532,122,624 exactly, as KerasHub lists it); Mixtral-8x7B: 46.7B and 12.9B (its paper);
    Qwen3.5-35B-A3B: 35B and 3B by its name (34.7B and 3.5B counted with the embeddings)."""
    total, expert = _parameters(name)
    if name == "qwen3-30b-a3b":
        assert total == 30_532_122_624
    active = total - expert + expert * routed // experts
    assert round(total / 1e9, 1) == total_b and abs(active / 1e9 - active_b) < 0.1


def test_phi_4_has_the_published_parameters():
    """Phi-4: 14.7B parameters (its model card says 14B)."""
    total, _ = _parameters("phi-4")
    assert round(total / 1e9, 1) == 14.7


def _glm_billions(name: str) -> tuple[float, float]:
    """(all parameters, the active ones without the embedding and LM head) of a GLM preset, in billions."""
    total, expert = _parameters(name)
    cfg = preset_config(f"preset:{name}")
    embeddings = 2 * cfg.vocab_size * cfg.hidden_size
    active = total - expert + expert * cfg.num_experts_per_tok // cfg.n_routed_experts - embeddings
    return total / 1e9, active / 1e9


def test_glm_air_has_the_published_total_and_active_parameters():
    """GLM-4.5-Air: 106B in all, 12B active (model card; active without the embedding and LM head)."""
    total, active = _glm_billions("glm4.5-air")
    assert int(total) == 106 and round(active) == 12


def test_glm_flash_has_the_published_total_and_active_parameters():
    """GLM-4.7-Flash: 30B in all, 3B active (its name; active without the embedding and LM head)."""
    total, active = _glm_billions("glm4.7-flash")
    assert round(total) == 30 and round(active) == 3


def test_random_weights_are_seeded_norms_one():
    a = build_random_target("preset:tiny", dtype=torch.float32, device="cpu", seed=5)
    b = build_random_target("preset:tiny", dtype=torch.float32, device="cpu", seed=5)
    c = build_random_target("preset:tiny", dtype=torch.float32, device="cpu", seed=6)
    for (name, p), q, r in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(p, q)
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)) and torch.equal(p, r)
        else:
            assert not torch.equal(p, r) and abs(float(p.std()) - 0.02) < 0.005, name
