"""Randomly initialised targets of real model shapes, for benchmarks (`preset:NAME`).

Speed depends on shapes, not weights, so `dflash-train bench` measures a Qwen3-8B-shaped
target without the 16 GB checkpoint. Weights are created directly on the device.
"""

from __future__ import annotations

from typing import Literal

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
    # Phi-4 (14B): fused q/k/v and gate/up projections
    "phi-4": dict(model_type="phi3", hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                  num_attention_heads=40, num_key_value_heads=10, vocab_size=100352, rms_norm_eps=1e-5,
                  rope_theta=250000.0, max_position_embeddings=16384, sliding_window=None, tie_word_embeddings=False),
    # A 27B-class dense target (Gemma-3-27B dimensions, Qwen3 blocks)
    "dense-27b": dict(model_type="qwen3", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                      num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=262144,
                      rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=131072,
                      tie_word_embeddings=True),
    # Llama-3.3-70B (one that needs a group of ranks: 141 GB in bf16, pipeline.target_group_size)
    "llama3.3-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                         num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         rms_norm_eps=1e-5, max_position_embeddings=131072,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192},
                         tie_word_embeddings=False),
    # Qwen3-235B-A22B: 94 MoE layers, 128 experts, 8 routed per token (470 GB in bf16: a group of ranks)
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            norm_topk_prob=True, decoder_sparse_step=1, vocab_size=151936, rms_norm_eps=1e-6,
                            rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False),
    # Qwen3-30B-A3B: 48 MoE layers, 128 experts, 8 routed per token
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                          vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                          tie_word_embeddings=False),
    # Mixtral-8x7B: 32 MoE layers, 8 experts, 2 routed per token (93 GB in bf16: one H200 holds it)
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_local_experts=8,
                         num_experts_per_tok=2, vocab_size=32000, rms_norm_eps=1e-5, rope_theta=1000000.0,
                         max_position_embeddings=32768, sliding_window=None, tie_word_embeddings=False),
    # GLM-4.5-Air: a dense layer, then 45 MoE layers (128 experts, 8 routed per token, a shared one, a
    # sigmoid router with a score correction bias); biased q/k/v, RoPE over half of each head (212 GB
    # in bf16: a group of ranks)
    "glm4.5-air": dict(model_type="glm4_moe", hidden_size=4096, intermediate_size=10944, moe_intermediate_size=1408,
                       num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                       n_routed_experts=128, num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1,
                       n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, attention_bias=True,
                       use_qk_norm=False, vocab_size=151552, rms_norm_eps=1e-5, max_position_embeddings=131072,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
                       tie_word_embeddings=False),
    # GLM-4.7-Flash (30B-A3B): DeepSeek's latent attention (a query rank, keys of 192 + 64 RoPE dims,
    # values of 256), a dense first layer, then 64 experts (4 a token) and a shared one under GLM's router
    "glm4.7-flash": dict(model_type="glm4_moe_lite", hidden_size=2048, intermediate_size=10240,
                         moe_intermediate_size=1536, num_hidden_layers=47, num_attention_heads=20,
                         num_key_value_heads=20, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=192,
                         qk_rope_head_dim=64, v_head_dim=256, n_routed_experts=64, num_experts_per_tok=4,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                         routed_scaling_factor=1.8, vocab_size=154880, rms_norm_eps=1e-5, rope_interleave=True,
                         max_position_embeddings=202752, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # gpt-oss-20b: 24 MoE layers (32 experts, 4 per token), sliding window 128 on every other layer,
    # attention sinks, YaRN RoPE
    "gpt-oss-20b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, vocab_size=201088, rms_norm_eps=1e-5, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"] * 12, max_position_embeddings=131072,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 4096},
                        tie_word_embeddings=False),
    # Gemma-3-27B's text stack: 5 sliding-window (1,024) layers to 1 global, scaled embeddings
    "gemma3-27b": dict(model_type="gemma3_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                       num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
                       sliding_window=1024, vocab_size=262208, rms_norm_eps=1e-6, max_position_embeddings=131072,
                       layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10 + ["sliding_attention"] * 2,
                       tie_word_embeddings=True),
    # Qwen3.5-27B's text stack: 3 gated-delta-net (linear attention) layers to 1 full-attention layer
    # (the Hugging Face forward; its fast kernels come with the `fla` extra)
    "qwen3.5-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, vocab_size=248320, rms_norm_eps=1e-6,
                        max_position_embeddings=262144, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
                        tie_word_embeddings=False),
    # Qwen3.5-35B-A3B: the hybrid stack of the 27B's kind (three linear-attention layers, then gated
    # attention) with 256 experts (8 a token) and a gated shared expert in every layer
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, moe_intermediate_size=512,
                            shared_expert_intermediate_size=512, num_experts=256, num_experts_per_tok=8,
                            num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                            linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                            linear_value_head_dim=128, linear_conv_kernel_dim=4, vocab_size=248320,
                            rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
                            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 10,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                             "partial_rotary_factor": 0.25}),
    # tiny, for CPU tests of the benchmark itself
    "tiny": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                 rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True),
    # the same for a hybrid stack (Qwen3.5's kind: three linear-attention layers, then gated attention)
    "tiny-qwen3.5": dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_conv_kernel_dim=4, vocab_size=512, rms_norm_eps=1e-6, max_position_embeddings=4096,
                         layer_types=["linear_attention"] * 3 + ["full_attention"], tie_word_embeddings=True),
}

PREFIX = "preset:"
# the preset names as a choice type (bench's --preset)
PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]


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


def initialise_(tensor: torch.Tensor, name: str, gen: torch.Generator) -> torch.Tensor:
    """A preset's value of parameter `name`, in place: 1 for a norm's weight, else N(0, 0.02) drawn
    from `gen`. Parameters drawn in `named_parameters()` order from one generator seeded alike
    give the same weights on every run, sharded (target/sharded.py) or not."""
    if name.endswith("norm.weight"):
        return tensor.fill_(1.0)
    return tensor.normal_(0.0, 0.02, generator=gen)


def build_random_target(spec: str, *, dtype, device, attn_implementation: str = "sdpa", seed: int = 0):
    """A frozen, eval-mode causal LM of the preset's shape with N(0, 0.02) weights (norms 1).

    Built on `device` itself, so that buffers the modules compute at construction (rotary
    tables, Gemma's embedding scale) are real; every parameter is then drawn from one seeded
    generator, so a preset's weights are the same on every run."""
    config = preset_config(spec)
    config._attn_implementation = attn_implementation
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            initialise_(p, name, gen)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.eval().requires_grad_(False)
