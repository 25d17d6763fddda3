"""OLMo 2's decoder layer, and EXAONE 4's, for the packed target forward (target/packed.py) and the
decoding engines (generate/layers.py), same contract as the Llama family's `pre_attention` /
`post_attention`: per-token functions that take the layer's weights as arguments.

Where they differ from a Llama block, each as transformers computes it:
* no norm before attention or the MLP: each output is normed after it, before its residual add;
* OLMo 2's RMSNorm scales in float32 and casts back after scaling (EXAONE 4's as Llama's:
  `scale_in_float32`);
* q and k are normed before RoPE: OLMo 2's over their whole projection (all heads at once),
  EXAONE 4's per head (the norm's width says which);
* EXAONE 4's global layers, between sliding-window ones, have no RoPE (target/language_model.py
  `layer_rope_tables`).
"""

from __future__ import annotations

from typing import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.target.ops import apply_rope, keys_for_attention, normed_qk, rms_norm
from dflash_train.target.projections import gated_mlp


def olmo2_qkv(x: Tensor, cos: Tensor, sin: Tensor, q_w: Tensor, q_b: Tensor | None, k_w: Tensor, k_b: Tensor | None,
              v_w: Tensor, v_b: Tensor | None, qn_w: Tensor, kn_w: Tensor, *, eps: float, n_heads: int, n_kv: int,
              head_dim: int, scale_in_float32: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """x [..., H] -> q [..., n_heads, D], k/v [..., n_kv, D]: q and k normed (over their projection, or
    per head where the norm is one head wide), then rotated."""
    q, k, v = F.linear(x, q_w, q_b), F.linear(x, k_w, k_b), F.linear(x, v_w, v_b)
    q, k = normed_qk(q, k, qn_w, kn_w, lambda t, w: rms_norm(t, w, eps, scale_in_float32=scale_in_float32),
                     n_heads=n_heads, n_kv=n_kv, head_dim=head_dim)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(*x.shape[:-1], n_kv, head_dim)


def pre_attention_olmo2(x: Tensor, cos: Tensor, sin: Tensor, *weights: Tensor | None, eps: float, n_heads: int,
                        n_kv: int, head_dim: int, scale_in_float32: bool = True,
                        grouped_kv: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The packed forward's: x [R, S, H] -> q, k, v [R, S, n_heads, D] (k/v repeated over each GQA group,
    or not: `grouped_kv`)."""
    q, k, v = olmo2_qkv(x, cos, sin, *weights, eps=eps, n_heads=n_heads, n_kv=n_kv, head_dim=head_dim,
                        scale_in_float32=scale_in_float32)
    return (q, *keys_for_attention(k, v, n_heads, grouped_kv))


def post_attention_olmo2(
    x: Tensor, attn_out: Tensor, o_w: Tensor, o_b: Tensor | None, post_attn_w: Tensor, gate_w: Tensor, up_w: Tensor,
    down_w: Tensor, post_ff_w: Tensor, *, eps: float, scale_in_float32: bool = True,
) -> Tensor:  # fmt: skip
    """Output projection, its norm, residual; the gated MLP, its norm, residual."""
    x = x + rms_norm(F.linear(attn_out, o_w, o_b), post_attn_w, eps, scale_in_float32=scale_in_float32)
    h = gated_mlp(x, (gate_w, None), (up_w, None), (down_w, None))
    return x + rms_norm(h, post_ff_w, eps, scale_in_float32=scale_in_float32)


class Olmo2LayerWeights:
    """One OLMo 2 (or EXAONE 4: `scale_in_float32` False) layer's weights as the two functions'
    arguments (no copies); `rope` its RoPE table's name (target/language_model.py `layer_rope_tables`)."""

    def __init__(self, layer: nn.Module, window: int | None = None, rope: str | None = None,
                 scale_in_float32: bool = True) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.pre: Sequence[Tensor | None] = (attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight,
                                             attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias,
                                             attn.q_norm.weight, attn.k_norm.weight)
        self.post: Sequence[Tensor | None] = (attn.o_proj.weight, attn.o_proj.bias,
                                              layer.post_attention_layernorm.weight, mlp.gate_proj.weight,
                                              mlp.up_proj.weight, mlp.down_proj.weight,
                                              layer.post_feedforward_layernorm.weight)
        eps = float(layer.post_attention_layernorm.variance_epsilon)
        scale = {"scale_in_float32": scale_in_float32}
        # how PackedForward calls this layer: which of its functions, with which options
        self.pre_fn, self.pre_kwargs = "pre_attention_olmo2", {"eps": float(attn.q_norm.variance_epsilon), **scale}
        self.post_fn, self.post_kwargs = "post_attention_olmo2", {"eps": eps, **scale}
        self.layer_type, self.window = rope, window
