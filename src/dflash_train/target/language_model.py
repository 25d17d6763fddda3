"""The language model inside a target: the text part of its config and of its modules.

A multimodal checkpoint (Gemma 3, Qwen3.5 / Qwen3-VL with a vision tower) loads as a wrapper
whose language model sits a module or two down (`model.model.language_model`) and whose
config keeps the text settings in a sub-config (`text_config`). What the drafter needs (the
layers to tap, the final norm, hidden size, layer count, vocabulary, the logit soft-cap)
belongs to the language model, and is found with transformers' own accessors
(`get_text_config`, `get_decoder`), the same on 5.17 and 5.25: never from shapes alone, as a
vision tower can have exactly as many layers as the text stack.

Read here too, for every code path that reproduces the target's layers (the packed forward, the
decoding engines): each layer's sliding window, and the q/k/v and gate/up projections as
(linear, rows), so that Phi-3's fused projections read as their row blocks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

# names of the final norm in the decoders transformers ships, in the order they are tried (Llama-style,
# Phi/Falcon, GPT-2, OPT, Mamba/Nemotron-H; LFM2 calls its final norm `embedding_norm`: tried last,
# since a model that norms its embeddings under that name has a final norm of an earlier name)
FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "final_layer_norm", "final_norm", "norm_f", "embedding_norm")


def text_config(config: Any) -> Any:
    """The config of the text decoder: the `text_config` of a multimodal config, else the config itself."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def language_model(model: nn.Module) -> nn.Module:
    """The module that runs the text decoder layers: `model.model` of a causal LM,
    `model.model.language_model` of a multimodal wrapper (transformers' `get_decoder()`); the
    model's `model` attribute for a module without that accessor."""
    get = getattr(model, "get_decoder", None)
    if callable(get):
        decoder = get()
        if isinstance(decoder, nn.Module):
            return decoder
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) else model


def find_decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of text decoder layers of a Hugging Face causal LM or multimodal wrapper."""
    n = int(text_config(model.config).num_hidden_layers)
    decoder = language_model(model)
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) == n:
        return layers
    for module in decoder.modules():  # other names (GPT-2's `h`): a list of n blocks inside the language model
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"{type(model).__name__}: cannot find its {n} text decoder layers")


def find_final_norm(model: nn.Module) -> nn.Module:
    """The language model's final norm (its output, through the LM head, gives the logits)."""
    decoder = language_model(model)
    for name in FINAL_NORM_NAMES:
        if isinstance(getattr(decoder, name, None), nn.Module):
            return getattr(decoder, name)
    raise ValueError(f"{type(model).__name__}: cannot find the final norm of its language model "
                     f"(needed for target labels)")


def final_logit_softcap(config: Any) -> float | None:
    """The cap of the target's logit soft-capping (Gemma 2: logits = cap * tanh(h W^T / cap)), or None."""
    cap = getattr(text_config(config), "final_logit_softcapping", None)
    return float(cap) if cap else None


# families whose causal-LM head scales the logits, and how the factor is read from the (text) config
_LOGIT_SCALES = {
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared", "granitemoehybrid", "granite_swa",
                     "granitemoe_swa", "minicpm3"), lambda c: 1.0 / float(c.logits_scaling)),
    "hyperclovax": lambda c: float(c.logits_scaling),
    "falcon_h1": lambda c: float(c.lm_head_multiplier),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), lambda c: float(c.logit_scale)),
}


def final_logit_scale(config: Any) -> float:
    """The factor the target's LM head multiplies its logits by (Granite divides them by
    `logits_scaling`, Falcon-H1 multiplies by `lm_head_multiplier`, Cohere by `logit_scale`); 1.0
    for every other family. Greedy tokens do not depend on it, the distribution distilled does."""
    cfg = text_config(config)
    read = _LOGIT_SCALES.get(getattr(cfg, "model_type", None))
    return read(cfg) if read is not None else 1.0


def rope_types(config: Any) -> set[str]:
    """Every RoPE type of the (text) config (Gemma 3 keeps one set of parameters per layer type)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    tables = [p for p in params.values() if isinstance(p, dict)] or [params]
    return {str(p.get("rope_type", p.get("type", "default"))) for p in tables}


NO_ROPE = "no_rope"  # the table of a layer that rotates nothing: cos 1, sin 0 (SmolLM3's NoPE layers)
PAIRED_ROPE = "paired"  # ERNIE 4.5's: each frequency on two neighbouring dims, turned by rotate_half's halves
PAIRED_ROPE_MODEL_TYPES = ("ernie4_5", "ernie4_5_moe")


def layer_rope_tables(cfg) -> list[str | None]:
    """The RoPE table each layer rotates q and k with: its layer type where the family keeps one
    table per type (Gemma 3's local layers have a base of their own), NO_ROPE for SmolLM3's
    layers without positions and EXAONE 4's global layers (beside sliding-window ones), PAIRED_ROPE
    for ERNIE 4.5's layers, else None (the model's one table)."""
    n = int(cfg.num_hidden_layers)
    if cfg.model_type == "gemma3_text":
        return list(cfg.layer_types[:n])
    if cfg.model_type == "smollm3":
        return [None if uses_rope else NO_ROPE for uses_rope in cfg.no_rope_layers[:n]]
    if cfg.model_type == "exaone4" and getattr(cfg, "sliding_window", None):  # its global layers have none
        return [None if kind == "sliding_attention" else NO_ROPE for kind in cfg.layer_types[:n]]
    if cfg.model_type in PAIRED_ROPE_MODEL_TYPES:
        return [PAIRED_ROPE] * n
    return [None] * n


def first_attention(inner: nn.Module) -> nn.Module:
    """The attention module of the language model's first attention layer (a hybrid stack's first
    layers may mix tokens otherwise)."""
    return next(layer.self_attn for layer in inner.layers if hasattr(layer, "self_attn"))


def rope_table(rotary: nn.Module, x: Tensor, positions: Tensor, name: str | None) -> tuple[Tensor, Tensor]:
    """(cos, sin) [.., positions, D] of table `name` (`layer_rope_tables`) from the model's own
    rotary module; NO_ROPE: ones and zeros of the same shape, so that rotating is the identity;
    PAIRED_ROPE: each frequency repeated on two neighbouring dims (in the module's float32)."""
    if name in (NO_ROPE, PAIRED_ROPE):
        cos, sin = rotary(x, positions)
        if name == NO_ROPE:
            return torch.ones_like(cos), torch.zeros_like(sin)
        half = cos.shape[-1] // 2  # [f0, f0, f1, f1, ...] from [f0, f1, ..., f0, f1, ...]
        return cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)
    if hasattr(rotary, "mrope_section") and positions.dim() == 2:  # Qwen3.5's multimodal RoPE: one row of
        positions = positions.expand(3, *positions.shape)  # positions per grid axis, all equal for text
    return rotary(x, positions, name) if name else rotary(x, positions)


# families whose `sliding_window`, when set, applies to every layer (their configs have no layer_types)
_WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "phi3")


def layer_windows(cfg) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers' masks apply them:
    by `layer_types` where the config has them, else (Mistral, Mixtral, Phi-3) on every layer when set."""
    n, window = int(cfg.num_hidden_layers), getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if not window:
        return [None] * n
    if types:
        return [int(window) if t == "sliding_attention" else None for t in types[:n]]
    every_layer = cfg.model_type in _WINDOW_ON_EVERY_LAYER
    return [int(window) if getattr(cfg, "use_sliding_window", every_layer) else None] * n


def attention_projections(attn: nn.Module) -> list[tuple[nn.Module, slice | None]]:
    """An attention module's q, k and v projections as (linear, its output rows; None: all): its
    q_proj, k_proj and v_proj, or the row blocks of Phi-3's fused qkv_proj."""
    fused = getattr(attn, "qkv_proj", None)
    if fused is None:
        return [(attn.q_proj, None), (attn.k_proj, None), (attn.v_proj, None)]
    q = attn.config.num_attention_heads * attn.head_dim
    kv = attn.config.num_key_value_heads * attn.head_dim
    return [(fused, slice(0, q)), (fused, slice(q, q + kv)), (fused, slice(q + kv, q + 2 * kv))]


def mlp_projections(mlp: nn.Module) -> list[tuple[nn.Module, slice | None]]:
    """A gated MLP's gate and up projections as (linear, its output rows; None: all): gate_proj and
    up_proj, or the halves of Phi-3's fused gate_up_proj (the gate first)."""
    fused = getattr(mlp, "gate_up_proj", None)
    if not isinstance(fused, nn.Module):  # (an MoE's experts keep a tensor of that name)
        return [(mlp.gate_proj, None), (mlp.up_proj, None)]
    half = fused.out_features // 2
    return [(fused, slice(0, half)), (fused, slice(half, 2 * half))]
