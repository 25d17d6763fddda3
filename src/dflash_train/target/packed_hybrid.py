"""Qwen3-Next and Qwen3.5 (dense and MoE) in the packed target forward (target/packed.py): most
layers mix tokens by gated delta-rule linear attention, every few a gated full attention.

    linear layers   zero-centred RMSNorm (scale 1 + w, in float32), then the model's own
                    GatedDeltaNet module on the documents gathered into a right-padded [D, L]
                    batch (target/documents.py): its short convolution and its recurrence start
                    afresh at each document and, causal, never read the padding after one.
                    transformers runs flash-linear-attention's kernels there when installed.
    attention       q_proj writes each head's query and an output gate; zero-centred q/k norms; RoPE
                    over part of a head; the output times sigmoid(gate) before o_proj
    MLP             zero-centred norm, then a gated MLP or the experts (softmax router, renormalised)
                    plus a shared expert scaled by sigmoid(shared_expert_gate(h))

Everything but the linear-attention module is per token and compiles with the rest; the module
runs as transformers wrote it (its kernels are the fast part).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.target.moe import moe_mlp, routing_of
from dflash_train.target.ops import apply_rope, keys_for_attention
from dflash_train.target.packed_gemma import gemma_rms_norm as zero_centred_norm
from dflash_train.target.projections import Projection, gated_mlp, project, projection_of

HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


def gated_qkv(
    x: Tensor, cos: Tensor, sin: Tensor, ln1_w: Tensor, q_p: Projection, k_p: Projection, v_p: Projection,
    qn_w: Tensor, kn_w: Tensor, *, eps: float, qk_eps: float, n_heads: int, n_kv: int, head_dim: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """x [..., H] -> q [..., n_heads, head_dim], k/v [..., n_kv, head_dim], normed and rotated, and
    the output gate [..., n_heads * head_dim]."""
    h = zero_centred_norm(x, ln1_w, eps)
    lead = h.shape[:-1]
    q_and_gate, k, v = project(h, (q_p, k_p, v_p))
    q, gate = q_and_gate.view(*lead, n_heads, 2 * head_dim).chunk(2, dim=-1)
    q = zero_centred_norm(q, qn_w, qk_eps)
    k = zero_centred_norm(k.view(*lead, n_kv, head_dim), kn_w, qk_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k, v.view(*lead, n_kv, head_dim), gate.reshape(*lead, n_heads * head_dim)


def pre_attention_gated(x: Tensor, cos: Tensor, sin: Tensor, *weights: Tensor | Projection, n_heads: int,
                        grouped_kv: bool = False, **options) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`gated_qkv` with k/v repeated over each GQA group (every SDPA kernel takes them), or not: `grouped_kv`."""
    q, k, v, gate = gated_qkv(x, cos, sin, *weights, n_heads=n_heads, **options)
    return (q, *keys_for_attention(k, v, n_heads, grouped_kv), gate)


def post_mixer_hybrid(x: Tensor, mixed: Tensor, ln2_w: Tensor, *mlp: Tensor | Projection, eps: float, moe: bool,
                      **routing) -> Tensor:
    """Residual of the token mixer's output `mixed`, norm, MLP (`mlp`: gate, up, down; or the router,
    the experts' gate_up and down, the shared expert's gate, up, down and its gate weight), residual."""
    x = x + mixed
    h = zero_centred_norm(x, ln2_w, eps)
    if not moe:
        return x + gated_mlp(h, *mlp)
    router_w, gate_up, down, shared_g, shared_u, shared_d, shared_gate_w = mlp
    shared = torch.sigmoid(F.linear(h, shared_gate_w)) * gated_mlp(h, shared_g, shared_u, shared_d)
    return x + moe_mlp(h, router_w, gate_up, down, **routing) + shared


def post_attention_hybrid(x: Tensor, attn_out: Tensor, gate: Tensor, o_p: Projection, *post: Tensor | Projection,
                          **options) -> Tensor:
    """The gated attention output through o_proj, then `post_mixer_hybrid`."""
    return post_mixer_hybrid(x, project(attn_out * torch.sigmoid(gate), (o_p,))[0], *post, **options)


def linear_attention(module: nn.Module, h: Tensor, layout) -> Tensor:
    """The model's linear-attention module on each document of the packed rows h [R, S, H] (layout:
    target/documents.py's maps; None when each row is one document from column 0)."""
    if layout is None:
        return module(h)
    return layout.packed(module(layout.docs(h)))


class HybridLayerWeights:
    """One layer's weights as the functions above take them (references, no copies); `mixer` is the
    linear-attention module, or None for a gated-attention layer."""

    def __init__(self, layer: nn.Module) -> None:
        self.mixer: nn.Module | None = getattr(layer, "linear_attn", None)
        self.ln1_w, self.ln1_eps = layer.input_layernorm.weight, float(layer.input_layernorm.eps)
        mlp = layer.mlp
        moe = hasattr(mlp, "experts")
        if moe:
            shared = mlp.shared_expert
            mlp_w: Sequence = (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj,
                               projection_of(shared.gate_proj), projection_of(shared.up_proj),
                               projection_of(shared.down_proj), mlp.shared_expert_gate.weight)
        else:
            mlp_w = (projection_of(mlp.gate_proj), projection_of(mlp.up_proj), projection_of(mlp.down_proj))
        ln2 = layer.post_attention_layernorm
        self.post_kwargs = {"eps": float(ln2.eps), "moe": moe, **(routing_of(mlp) if moe else {})}
        # one RoPE table (`rope`: the static decoder's name for it), no sliding windows, no sinks
        self.layer_type = self.rope = self.window = self.sinks = None
        if self.mixer is not None:
            self.post_fn, self.post = "post_mixer_hybrid", (ln2.weight, *mlp_w)
            return
        attn = layer.self_attn
        self.pre_fn = "pre_attention_gated"
        self.pre = (self.ln1_w, *(projection_of(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)),
                    attn.q_norm.weight, attn.k_norm.weight)
        self.pre_kwargs = {"eps": self.ln1_eps, "qk_eps": float(attn.q_norm.eps)}
        self.post_fn, self.post = "post_attention_hybrid", (projection_of(attn.o_proj), ln2.weight, *mlp_w)


def experts_with_gated_shared_expert(mlp: nn.Module) -> bool:
    """Whether a hybrid's MoE block is laid out as `post_mixer_hybrid` takes it: a router, 3D experts,
    a shared gated MLP and its one-output gate."""
    experts, shared = getattr(mlp, "experts", None), getattr(mlp, "shared_expert", None)
    return (all(isinstance(getattr(experts, n, None), torch.Tensor) for n in ("gate_up_proj", "down_proj"))
            and shared is not None and isinstance(getattr(mlp, "shared_expert_gate", None), nn.Linear)
            and hasattr(mlp.gate, "top_k"))
