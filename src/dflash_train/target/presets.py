"""Randomly initialised targets of real model shapes, for benchmarks (`preset:NAME`).

Speed depends on shapes, not weights, so `dflash-train bench` measures a Qwen3-8B-shaped
target without the 16 GB checkpoint. Weights are created directly on the device.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_train.utils.errors import ConfigError

PRESETS: dict[str, dict] = {
    # SmolLM2-135M-Instruct (Llama)
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
                         tie_word_embeddings=True),
    # Qwen3-8B
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False),
    # A 27B-class dense target like the seed notes' (Gemma-3-27B dimensions, Qwen3 blocks)
    "dense-27b": dict(model_type="qwen3", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                      num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262144,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=131072,
                      tie_word_embeddings=True),
    # tiny, for CPU tests of the benchmark itself
    "tiny": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                 rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True),
}

PREFIX = "preset:"


def is_preset(spec) -> bool:
    return isinstance(spec, str) and spec.startswith(PREFIX)


def preset_config(spec: str):
    """The Hugging Face config of `preset:NAME`."""
    name = spec[len(PREFIX):]
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    kwargs = dict(PRESETS[name])
    model_type = kwargs.pop("model_type")
    return AutoConfig.for_model(model_type, **kwargs)


def build_random_target(spec: str, *, dtype, device, attn_implementation: str = "sdpa", seed: int = 0):
    """A frozen, eval-mode causal LM of the preset's shape with N(0, 0.02) weights."""
    config = preset_config(spec)
    config._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        # rotary tables were created on the meta device: build those modules again for real
        for parent in list(model.modules()):
            for child_name, child in list(parent.named_children()):
                if type(child).__name__.endswith("RotaryEmbedding"):
                    with torch.device(device):
                        setattr(parent, child_name, type(child)(child.config))
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval().requires_grad_(False)
