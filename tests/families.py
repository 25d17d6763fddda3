"""Tiny random models of every family the field trains drafters for, built in-process.

Each family is its transformers config at toy size (hidden 64, 4 layers, 4 heads; windows of 8
tokens so that a short decode fills them) and the family's own chat template and special tokens
(tests/family_templates.py). `save_family(name, dir)` writes a Hugging Face model directory
(safetensors + tokenizer), as a user's checkpoint would be.

Weights use a wide init range, so greedy choices are far from ties and fp32 rounding cannot
flip them between a one-token and a many-token forward.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

WINDOW = 8  # sliding window of the windowed families: a 20-token prompt already overflows it
LAYERS = 4
INIT = 0.15

_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, initializer_range=INIT, tie_word_embeddings=False)


def _llama(vocab):
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON, vocab_size=vocab, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})


def _mistral(vocab, window=None):
    from transformers import MistralConfig

    return MistralConfig(**_COMMON, vocab_size=vocab, head_dim=16, sliding_window=window)


def _qwen2(vocab):
    from transformers import Qwen2Config

    return Qwen2Config(**{**_COMMON, "tie_word_embeddings": True}, vocab_size=vocab)


def _qwen3(vocab):
    from transformers import Qwen3Config

    return Qwen3Config(**_COMMON, vocab_size=vocab, head_dim=16)


def _mixtral(vocab):
    from transformers import MixtralConfig

    return MixtralConfig(**_COMMON, vocab_size=vocab, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                         sliding_window=WINDOW)


def _qwen3_moe(vocab):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_COMMON, vocab_size=vocab, head_dim=16, num_experts=8, num_experts_per_tok=2,
                          moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)


_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
               linear_num_value_heads=4)
_HYBRID = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def _qwen3_next(vocab):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**_COMMON, **_LINEAR, vocab_size=vocab, head_dim=16, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                           layer_types=_HYBRID, partial_rotary_factor=0.25)


def _qwen3_5(vocab):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**_COMMON, **_LINEAR, vocab_size=vocab, head_dim=16, layer_types=_HYBRID)


def _gemma2(vocab):
    from transformers import Gemma2Config

    return Gemma2Config(**{**_COMMON, "tie_word_embeddings": True}, vocab_size=vocab, head_dim=16,
                        sliding_window=WINDOW, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                        attn_logit_softcapping=50.0, hidden_activation="gelu_pytorch_tanh")


def _gemma3_text(vocab):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**_COMMON, "tie_word_embeddings": True}, vocab_size=vocab, head_dim=16,
                            sliding_window=WINDOW, query_pre_attn_scalar=16, sliding_window_pattern=2,
                            layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2))


def _gemma3(vocab):
    from transformers import Gemma3Config, SiglipVisionConfig

    text = _gemma3_text(vocab)
    # the vision tower as deep as the text stack: a layer finder that takes the first list of
    # LAYERS blocks would pick the vision layers
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                                num_attention_heads=2, image_size=28, patch_size=14)
    return Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                        image_token_index=vocab - 1, boi_token_index=vocab - 2, eoi_token_index=vocab - 3,
                        initializer_range=INIT)


def _phi3(vocab, window=None, rotary=1.0):
    """Phi-3 (fused q/k/v and gate/up projections); `rotary` < 1: RoPE over that share of a head."""
    from transformers import Phi3Config

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": rotary}
    return Phi3Config(**_COMMON, vocab_size=vocab, pad_token_id=0, sliding_window=window, rope_parameters=rope)


def _gpt_oss(vocab):
    from transformers import GptOssConfig

    return GptOssConfig(**_COMMON, vocab_size=vocab, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "original_max_position_embeddings": 128, "truncate": False})


# latent attention's families: a latent of 24 and a rotary key of 8, so that the engines' one cached
# head is 32 wide (a width FlexAttention's GPU kernels take)
def _deepseek_v3(vocab):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**{**_COMMON, "num_key_value_heads": 4}, vocab_size=vocab, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                            topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1, kv_lora_rank=24,
                            q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                            n_shared_experts=1, rope_interleave=True)


def _glm4_moe(vocab):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**_COMMON, vocab_size=vocab, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                         n_group=2, topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1,
                         n_shared_experts=1, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                         routed_scaling_factor=2.5)


def _olmo2(vocab):
    from transformers import Olmo2Config

    return Olmo2Config(**_COMMON, vocab_size=vocab, pad_token_id=0)


# --- families of 2025-26 releases: most run every job on the model's own forward (hybrids, latent
# attention, other routers and norms); SmolLM3 and Seed-OSS also on the fast paths ---

def _qwen3_5_moe(vocab):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**_COMMON, **_LINEAR, vocab_size=vocab, head_dim=16, layer_types=_HYBRID,
                                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32)


def _glm4_moe_lite(vocab):
    """GLM-4.7-Flash: DeepSeek's latent attention with GLM's router."""
    from transformers import Glm4MoeLiteConfig

    return Glm4MoeLiteConfig(**{**_COMMON, "num_key_value_heads": 4}, vocab_size=vocab, n_routed_experts=8,
                             num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                             first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=32, qk_rope_head_dim=8,
                             qk_nope_head_dim=8, v_head_dim=16, n_shared_experts=1)


def _minimax_m2(vocab):
    """MiniMax-M2: q/k normed over the whole projection, RoPE over half a head, a sigmoid router with
    the block's score correction bias."""
    from transformers import MiniMaxM2Config

    return MiniMaxM2Config(**_COMMON, vocab_size=vocab, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                           rotary_dim=8)


def _lfm2(vocab):
    """LFM2: short gated convolutions (a rolling state) between attention layers."""
    from transformers import Lfm2Config

    return Lfm2Config(**_COMMON, vocab_size=vocab, layer_types=["conv", "full_attention"] * (LAYERS // 2))


def _nemotron_h(vocab):
    """Nemotron-H: Mamba-2, attention, MoE and MLP blocks, one kind a layer."""
    from transformers import NemotronHConfig

    common = {k: v for k, v in _COMMON.items() if k != "num_hidden_layers"}  # the block list sets the depth
    return NemotronHConfig(**common, vocab_size=vocab, head_dim=16, layers_block_type=["mamba", "attention", "moe",
                           "mlp"], mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16,
                           n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           moe_shared_expert_intermediate_size=32)


def _granitemoehybrid(vocab):
    """Granite 4: Mamba-2 and attention layers; its head divides the logits by `logits_scaling`."""
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(**_COMMON, vocab_size=vocab, layer_types=["mamba", "attention"] * (LAYERS // 2),
                                  num_local_experts=8, num_experts_per_tok=2, mamba_n_heads=8, mamba_d_head=16,
                                  mamba_d_state=16, mamba_chunk_size=16, logits_scaling=4.0)


def _falcon_h1(vocab):
    """Falcon-H1: attention and Mamba-2 side by side in every layer; a multiplier on the logits."""
    from transformers import FalconH1Config

    return FalconH1Config(**_COMMON, vocab_size=vocab, head_dim=16, mamba_n_heads=4, mamba_d_head=16,
                          mamba_d_ssm=64, mamba_d_state=16, mamba_chunk_size=16, lm_head_multiplier=0.5)


def _kimi_linear(vocab):
    """Kimi Linear: delta-rule linear attention with latent attention every fourth layer."""
    from transformers import KimiLinearConfig

    return KimiLinearConfig(**{**_COMMON, "num_key_value_heads": 4}, vocab_size=vocab, pad_token_id=0,
                            num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, kv_lora_rank=16,
                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                            linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 16,
                                                "num_heads": 4, "short_conv_kernel_size": 4})


def _smollm3(vocab):
    """SmolLM3: every fourth layer without RoPE."""
    from transformers import SmolLM3Config

    return SmolLM3Config(**_COMMON, vocab_size=vocab, pad_token_id=0, no_rope_layer_interval=2)


def _seed_oss(vocab):
    from transformers import SeedOssConfig

    return SeedOssConfig(**_COMMON, vocab_size=vocab, head_dim=16, attention_bias=True, attention_out_bias=True)


def _exaone4(vocab):
    """EXAONE 4: norms after attention and MLP, local layers with RoPE, global ones without."""
    from transformers import Exaone4Config

    return Exaone4Config(**_COMMON, vocab_size=vocab, sliding_window=WINDOW, sliding_window_pattern=2)


def _ernie4_5_moe(vocab):
    """ERNIE 4.5: RoPE in float32 over paired dims, a float32 router choosing experts with a bias,
    a dense first layer, shared experts, biased projections."""
    from transformers import Ernie4_5_MoeConfig

    return Ernie4_5_MoeConfig(**_COMMON, vocab_size=vocab, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
                              moe_num_shared_experts=1, moe_layer_start_index=1, use_bias=True)


def _apertus(vocab):
    """Apertus: xIELU activation, q/k norms, Llama 3 RoPE."""
    from transformers import ApertusConfig

    return ApertusConfig(**_COMMON, vocab_size=vocab)


@dataclass(frozen=True)
class Family:
    name: str
    config: Callable[[int], object]  # vocabulary rows -> transformers config
    template: str  # key of tests/family_templates.py TEMPLATES
    windowed: bool = False  # has sliding-window layers (a decode past WINDOW rolls them back)
    recurrent: bool = False  # has linear-attention (recurrent state) layers
    multimodal: bool = False  # the language model sits inside a wrapper


FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", _llama, "llama3"),
    Family("mistral", _mistral, "mistral"),
    Family("mistral_window", lambda v: _mistral(v, WINDOW), "mistral", windowed=True),
    Family("qwen2", _qwen2, "chatml"),
    Family("qwen3", _qwen3, "qwen3"),
    Family("qwen3_moe", _qwen3_moe, "qwen3"),
    Family("mixtral", _mixtral, "mistral", windowed=True),
    Family("qwen3_next", _qwen3_next, "qwen3", recurrent=True),
    Family("qwen3_5", _qwen3_5, "qwen3_5", recurrent=True),
    Family("gemma2", _gemma2, "gemma", windowed=True),
    Family("gemma3_text", _gemma3_text, "gemma", windowed=True),
    Family("gemma3", _gemma3, "gemma", windowed=True, multimodal=True),
    Family("phi3", _phi3, "phi3"),
    Family("phi3_window", lambda v: _phi3(v, WINDOW, rotary=0.5), "phi3", windowed=True),  # partial RoPE too
    Family("gpt_oss", _gpt_oss, "gpt_oss", windowed=True),
    Family("deepseek_v3", _deepseek_v3, "deepseek_v3"),
    Family("glm4_moe", _glm4_moe, "glm4_moe"),
    Family("olmo2", _olmo2, "olmo2"),
    # the template stands in where the family's own is not in tests/family_templates.py: the
    # layers, not the template, are what these entries test
    Family("qwen3_5_moe", _qwen3_5_moe, "qwen3_5", recurrent=True),
    Family("glm4_moe_lite", _glm4_moe_lite, "glm4_moe"),
    Family("minimax_m2", _minimax_m2, "chatml"),
    Family("lfm2", _lfm2, "chatml", recurrent=True),
    Family("nemotron_h", _nemotron_h, "chatml", recurrent=True),
    Family("granitemoehybrid", _granitemoehybrid, "chatml", recurrent=True),
    Family("falcon_h1", _falcon_h1, "chatml", recurrent=True),
    Family("kimi_linear", _kimi_linear, "chatml", recurrent=True),
    Family("smollm3", _smollm3, "chatml"),
    Family("seed_oss", _seed_oss, "chatml"),
    Family("exaone4", _exaone4, "chatml", windowed=True),
    Family("ernie4_5_moe", _ernie4_5_moe, "chatml"),
    Family("apertus", _apertus, "llama3"),
)}


def build_model(name: str, vocab: int, seed: int = 0):
    """A random model of family `name` with `vocab` embedding rows, fp32, eval mode."""
    from transformers import AutoModelForCausalLM, Gemma3ForConditionalGeneration

    cfg = FAMILIES[name].config(vocab)
    torch.manual_seed(seed)
    if FAMILIES[name].multimodal:
        model = Gemma3ForConditionalGeneration(cfg)
    else:
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return perturbed(model, seed).eval()


@torch.no_grad()
def perturbed(model, seed: int = 0):
    """`model` with every parameter moved a little: transformers initialises some tensors (norms,
    biases, sinks) at 0 or 1; and with GLM's router score correction (a buffer saved with the
    weights, 0 at init) drawn, so that it changes which experts are chosen."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=gen) * INIT * 0.2)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=gen) * 0.3)
    return model


def save_family(name: str, directory: str | Path, seed: int = 0):
    """Save tokenizer + random model of family `name` to `directory`; returns (model, tokenizer)."""
    from tests.family_templates import build_tokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(FAMILIES[name].template)
    tokenizer.save_pretrained(str(directory))
    # a few rows past the tokenizer: a never-produced row for the drafter's MASK token
    model = build_model(name, len(tokenizer) + 8, seed)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            setattr(model.generation_config, key, value)
    model.save_pretrained(str(directory), safe_serialization=True)
    (directory / "family.json").write_text(json.dumps({"family": name}))
    return model, tokenizer
