"""gpt-oss decoder layers for the packed target forward (target/packed.py), same contract as
its Llama-family `pre_attention` / `post_attention`.

Where gpt-oss differs from a Llama block, each as transformers computes it:
* RMSNorm scales in float32 and casts the product (`rms_norm(..., scale_in_float32=True)`);
* q/k/v/o carry biases; RoPE tables are half-width (YaRN), the same rotation as rotate_half
  on the table repeated twice;
* attention sinks: each head's softmax has one more logit, its learned sink, that takes
  probability mass and adds no value. With FlexAttention's log-sum-exp of the real scores,
  softmax([s, sink]) @ [v, 0] = out * sigmoid(lse - sink), so every layer runs FlexAttention
  (full layers under the causal-within-document mask, the others cut to the window);
* the MLP is a mixture of 32 experts with biases and a clamped SwiGLU (target/moe.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.target.moe import moe_mlp_gpt_oss
from dflash_train.target.ops import apply_rope, keys_for_attention, rms_norm


def pre_attention_gpt_oss(
    x: Tensor, cos: Tensor, sin: Tensor, ln1_w: Tensor, q_w: Tensor, q_b: Tensor | None, k_w: Tensor,
    k_b: Tensor | None, v_w: Tensor, v_b: Tensor | None, *, eps: float, n_heads: int, n_kv: int, head_dim: int,
    grouped_kv: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """x [R, S, H] -> q, k, v [R, S, n_heads, head_dim] (k/v repeated over each GQA group, or not: `grouped_kv`)."""
    h = rms_norm(x, ln1_w, eps, scale_in_float32=True)
    R, S = h.shape[:2]
    q = F.linear(h, q_w, q_b).view(R, S, n_heads, head_dim)
    k = F.linear(h, k_w, k_b).view(R, S, n_kv, head_dim)
    v = F.linear(h, v_w, v_b).view(R, S, n_kv, head_dim)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return (q, *keys_for_attention(k, v, n_heads, grouped_kv))


def sink_attention_scale(lse: Tensor, sinks: Tensor) -> Tensor:
    """lse [R, heads, S] of the real scores -> the factor [R, S, heads, 1] that gives each
    head's output its share of a softmax that also holds the head's sink logit."""
    return torch.sigmoid(lse - sinks.float()[None, :, None]).transpose(1, 2)[..., None]


def post_attention_gpt_oss(
    x: Tensor, attn_out: Tensor, o_w: Tensor, o_b: Tensor | None, ln2_w: Tensor, router_w: Tensor, router_b: Tensor,
    gate_up: Tensor, gate_up_b: Tensor, down: Tensor, down_b: Tensor, *, eps: float, top_k: int, alpha: float,
    limit: float,
) -> Tensor:  # fmt: skip
    """Output projection, residual, norm, the experts, residual."""
    x = x + F.linear(attn_out, o_w, o_b)
    h = rms_norm(x, ln2_w, eps, scale_in_float32=True)
    return x + moe_mlp_gpt_oss(h, router_w, router_b, gate_up, gate_up_b, down, down_b, top_k=top_k, alpha=alpha,
                               limit=limit)


def experts_as_gpt_oss_stores_them(mlp: nn.Module) -> bool:
    router, experts = getattr(mlp, "router", None), getattr(mlp, "experts", None)
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias", "alpha", "limit")
    return all(hasattr(router, a) for a in ("weight", "bias", "top_k")) and all(hasattr(experts, a) for a in names)


class GptOssLayerWeights:
    """One gpt-oss layer's weights as the two functions' arguments (no copies)."""

    def __init__(self, layer: nn.Module, window: int | None) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.pre: Sequence[Tensor | None] = (layer.input_layernorm.weight, attn.q_proj.weight, attn.q_proj.bias,
                                             attn.k_proj.weight, attn.k_proj.bias, attn.v_proj.weight,
                                             attn.v_proj.bias)
        experts = mlp.experts
        self.post: Sequence[Tensor | None] = (attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight,
                                              mlp.router.weight, mlp.router.bias, experts.gate_up_proj,
                                              experts.gate_up_proj_bias, experts.down_proj, experts.down_proj_bias)
        eps = float(layer.input_layernorm.variance_epsilon)
        # how PackedForward calls this layer: which of its functions, with which options
        self.pre_fn, self.pre_kwargs = "pre_attention_gpt_oss", {"eps": eps}
        self.post_fn = "post_attention_gpt_oss"
        self.post_kwargs = {"eps": float(layer.post_attention_layernorm.variance_epsilon), "top_k": int(mlp.router.top_k),
                            "alpha": float(experts.alpha), "limit": float(experts.limit)}
        self.layer_type = None  # one RoPE table
        self.window = window
        self.sinks = attn.sinks
