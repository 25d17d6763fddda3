"""Gemma 2 and Gemma 3 decoder layers for the packed target forward (target/packed.py), same contract as
its Llama-family `pre_attention` / `post_attention`: per-token functions of packed rows that
take the layer's weights as arguments (one compiled graph serves every layer).

Where Gemma 3 differs from a Llama block, each as transformers computes it:
* RMSNorm scales by (1 + w), in float32, and casts back after scaling;
* four norms a layer: before and after attention, before and after the MLP (the "sandwich");
* Gemma 3 norms q and k per head before RoPE, and its RoPE tables differ by layer type (local
  layers use their own base); queries are scaled by query_pre_attn_scalar^-0.5;
* Gemma 2 soft-caps its attention scores (cap * tanh(score / cap), a FlexAttention score_mod,
  so every layer runs FlexAttention);
* the MLP is gated with tanh-approximated GELU;
* the embedding is scaled by sqrt(hidden) (in the weights' dtype);
* sliding-window layers see the last `sliding_window` keys of their document (the packed
  forward gives them a windowed FlexAttention block mask).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.target.ops import apply_rope, keys_for_attention

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")  # the text stacks this module reproduces


def gemma_rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * (xf.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * (1.0 + w.float())).type_as(x)


def pre_attention_gemma(
    x: Tensor, cos: Tensor, sin: Tensor, ln1_w: Tensor, q_w: Tensor, k_w: Tensor, v_w: Tensor, qn_w: Tensor | None,
    kn_w: Tensor | None, *, eps: float, n_heads: int, n_kv: int, head_dim: int, grouped_kv: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """x [R, S, H] -> q, k, v [R, S, n_heads, head_dim] (k/v repeated over each GQA group, or not:
    `grouped_kv`)."""
    h = gemma_rms_norm(x, ln1_w, eps)
    R, S = h.shape[:2]
    q = F.linear(h, q_w).view(R, S, n_heads, head_dim)
    k = F.linear(h, k_w).view(R, S, n_kv, head_dim)
    v = F.linear(h, v_w).view(R, S, n_kv, head_dim)
    if qn_w is not None and kn_w is not None:  # Gemma 3
        q, k = gemma_rms_norm(q, qn_w, eps), gemma_rms_norm(k, kn_w, eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return (q, *keys_for_attention(k, v, n_heads, grouped_kv))


def post_attention_gemma(
    x: Tensor, attn_out: Tensor, o_w: Tensor, post_attn_w: Tensor, pre_ff_w: Tensor, gate_w: Tensor, up_w: Tensor,
    down_w: Tensor, post_ff_w: Tensor, *, eps: float,
) -> Tensor:  # fmt: skip
    """Output projection, its norm and residual; the MLP between its two norms, residual."""
    x = x + gemma_rms_norm(F.linear(attn_out, o_w), post_attn_w, eps)
    h = gemma_rms_norm(x, pre_ff_w, eps)
    h = F.linear(F.gelu(F.linear(h, gate_w), approximate="tanh") * F.linear(h, up_w), down_w)
    return x + gemma_rms_norm(h, post_ff_w, eps)


def soft_capped(cap: float):
    """A FlexAttention score_mod: Gemma 2's cap * tanh(score / cap) of the scaled scores."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.tanh(score / cap) * cap

    return score_mod


class GemmaLayerWeights:
    """One Gemma 2 or 3 layer's weights as the two functions' arguments (no copies)."""

    def __init__(self, layer: nn.Module, layer_type: str | None, window: int | None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.pre: Sequence[Tensor | None] = (layer.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight,
                                             attn.v_proj.weight, q_norm.weight if q_norm is not None else None,
                                             k_norm.weight if k_norm is not None else None)
        self.post: Sequence[Tensor] = (attn.o_proj.weight, layer.post_attention_layernorm.weight,
                                       layer.pre_feedforward_layernorm.weight, mlp.gate_proj.weight,
                                       mlp.up_proj.weight, mlp.down_proj.weight,
                                       layer.post_feedforward_layernorm.weight)
        eps = float(layer.input_layernorm.eps)
        # how PackedForward calls this layer: which of its functions, with which options
        self.pre_fn, self.pre_kwargs = "pre_attention_gemma", {"eps": eps}
        self.post_fn, self.post_kwargs = "post_attention_gemma", {"eps": eps}
        self.layer_type = layer_type  # its RoPE table (Gemma 3: one per layer type; Gemma 2: None, one table)
        self.window = window
