"""One decoder layer of the static-KV decoder (generate/decoder.py), for each family it runs.

A layer is two functions around attention, `pre_attention` (norm, q/k/v, q/k norms, RoPE) and
`post_attention` (output projection, residuals, the MLP), that take the layer's weights as plain
tensor arguments: a torch.compile'd version is traced once per layer kind and serves every layer.
`LayerWeights` groups one layer's weights (references, no copies) as those arguments, with the
options that say which family's op sequence runs:

    llama    Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), Qwen3-MoE, Mixtral and GLM-4.5 (target/moe.py;
             GLM's shared experts), Phi-3 (fused qkv_proj and gate_up_proj, read as row blocks),
             SmolLM3, Seed-OSS, MiniMax-M2 (q/k normed over the whole projection, a sigmoid router),
             ERNIE 4.5 (RoPE over neighbouring pairs in float32, a router choosing with a bias)
    gemma    Gemma 2 and 3: (1 + w) RMSNorm, four norms a layer, tanh-GELU MLP (target/packed_gemma.py)
    gpt_oss  biased projections, RMSNorm scaled in float32, biased clamped-SwiGLU experts
             (target/packed_gpt_oss.py, target/moe.py)
    olmo2    norms after attention and the MLP (scaled in float32), q/k normed over their whole
             projection (target/packed_olmo2.py); exaone4 the same with Llama's norms, q/k normed per head
    mla      DeepSeek-V3 / R1 and GLM-4.7-Flash: latent attention with the latent cached and the
             up-projections absorbed (one shared kv head; target/packed_mla.py), then the llama kind's
             MLP or GLM-routed experts
    hybrid   Qwen3-Next and Qwen3.5: gated attention and zero-centred norms (target/packed_hybrid.py)
             in the attention layers, gated delta-rule linear attention in the rest
             (generate/hybrid_decoder.py, generate/linear_state.py)

What differs around the layers (Gemma's scaled embedding, per-layer-type RoPE tables and
sliding windows, soft-capped scores and logits, gpt-oss's attention sinks) is the decoder's.
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.generate.attention import write_cache
from dflash_train.target.language_model import PAIRED_ROPE_MODEL_TYPES, attention_projections, mlp_projections
from dflash_train.target.moe import experts_as_tensors, moe_mlp, router_bias, routing_of
from dflash_train.target.ops import apply_rope, normed_qk, rms_norm, soft_cap
from dflash_train.target.projections import gated_mlp, projection_of
from dflash_train.target.packed_gemma import (GEMMA_MODEL_TYPES, GemmaLayerWeights, gemma_rms_norm,
                                              post_attention_gemma)
from dflash_train.target.packed_hybrid import HYBRID_MODEL_TYPES, experts_with_gated_shared_expert
from dflash_train.target.packed_gpt_oss import (GptOssLayerWeights, experts_as_gpt_oss_stores_them,
                                                post_attention_gpt_oss)
from dflash_train.target.packed_mla import MLA_MODEL_TYPES, latent_output, latent_qkv, latent_weights, up_projections
from dflash_train.target.packed_olmo2 import Olmo2LayerWeights, olmo2_qkv, post_attention_olmo2

LayerKind = Literal["llama", "gemma", "gpt_oss", "olmo2", "exaone4", "mla", "hybrid"]
POST_NORM_KINDS = ("olmo2", "exaone4")  # norms after attention and the MLP (target/packed_olmo2.py)


def layer_kind(model_type: str) -> LayerKind:
    if model_type in GEMMA_MODEL_TYPES:
        return "gemma"
    if model_type in MLA_MODEL_TYPES:
        return "mla"
    if model_type in HYBRID_MODEL_TYPES:
        return "hybrid"
    return model_type if model_type in ("gpt_oss", *POST_NORM_KINDS) else "llama"


def norm(x: Tensor, w: Tensor, eps: float, kind: LayerKind) -> Tensor:
    """The family's RMSNorm, as transformers computes it."""
    if kind in ("gemma", "hybrid"):  # zero-centred: scale 1 + w
        return gemma_rms_norm(x, w, eps)
    return rms_norm(x, w, eps, scale_in_float32=kind in ("gpt_oss", "olmo2"))


def pre_attention(
    x: Tensor, cos: Tensor, sin: Tensor, *weights: Tensor | None, eps: float, qk_eps: float, n_heads: int,
    n_kv: int, head_dim: int, kind: LayerKind = "llama", paired_rope: bool = False, **options,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """x [..., H] -> q [..., n_heads, D], k/v [..., n_kv, D], normed and rotated. `weights`: the
    kind's (LayerWeights.pre): (ln1, wq, bq, wk, bk, wv, bv, q norm, k norm) but for latent
    attention (`options`: its own, target/packed_mla.py `latent_weights`).

    `cos`/`sin` must broadcast against [..., heads, D] (a heads axis of size 1)."""
    if kind == "mla":
        return latent_qkv(x, cos, sin, *weights, eps=eps, n_heads=n_heads, head_dim=head_dim, **options)
    ln1_w, wq, bq, wk, bk, wv, bv, qn_w, kn_w = weights
    if kind in POST_NORM_KINDS:  # no norm before attention; q and k normed
        return olmo2_qkv(x, cos, sin, wq, bq, wk, bk, wv, bv, qn_w, kn_w, eps=qk_eps, n_heads=n_heads, n_kv=n_kv,
                         head_dim=head_dim, scale_in_float32=kind == "olmo2")
    h = norm(x, ln1_w, eps, kind)
    q, k, v = F.linear(h, wq, bq), F.linear(h, wk, bk), F.linear(h, wv, bv)
    q, k = normed_qk(q, k, qn_w, kn_w, lambda t, w: norm(t, w, qk_eps, kind), n_heads=n_heads, n_kv=n_kv,
                     head_dim=head_dim)  # Qwen3, Gemma 3: per head; MiniMax-M2: over the whole projection
    v = v.view(*h.shape[:-1], n_kv, head_dim)
    return apply_rope(q, cos, sin, paired_rope), apply_rope(k, cos, sin, paired_rope), v


def q_writing_kv(
    x: Tensor, cos: Tensor, sin: Tensor, *pre: Tensor | None, k_flat: Tensor, v_flat: Tensor, index: Tensor,
    eps: float, qk_eps: float, n_heads: int, n_kv: int, head_dim: int, kind: LayerKind = "llama", **options,
) -> Tensor:  # fmt: skip
    """`pre_attention` that writes k/v into the cache (flat views, at `index`: generate/attention.py)
    and returns q: compiled, the writes fuse into the kernels computing k and v."""
    q, k, v = pre_attention(x, cos, sin, *pre, eps=eps, qk_eps=qk_eps, n_heads=n_heads, n_kv=n_kv, head_dim=head_dim,
                            kind=kind, **options)
    write_cache(k_flat, index, k)
    write_cache(v_flat, index, v)
    return q


def post_attention(
    x: Tensor, attn_out: Tensor, *weights: Tensor | None, eps: float, kind: LayerKind = "llama", top_k: int = 0,
    alpha: float = 0.0, limit: float = 0.0, **routing,
) -> Tensor:  # fmt: skip
    """Output projection, residual adds and the MLP: the rest of one decoder layer. `weights` are
    the layer kind's (LayerWeights.post): a Llama-family gated MLP's (wo, bo, ln2, wg, bg, wu, bu,
    wd, bd), with `top_k` a mixture's (wo, bo, ln2, router, router bias, gate_up, down, shared
    (w, b) projections: GLM-4.5's bias and shared experts, None for Qwen3-MoE; `routing` the rest of
    target/moe.py's routing_of), after W_uv for latent attention (kind mla); Gemma's and gpt-oss's
    as their packed-forward functions take them. A kind is a fixed argument count, so a compiled
    version traces each kind once."""
    if kind == "gemma":
        return post_attention_gemma(x, attn_out, *weights, eps=eps)
    if kind == "gpt_oss":
        return post_attention_gpt_oss(x, attn_out, *weights, eps=eps, top_k=top_k, alpha=alpha, limit=limit)
    if kind in POST_NORM_KINDS:
        return post_attention_olmo2(x, attn_out, *weights, eps=eps, scale_in_float32=kind == "olmo2")
    if kind == "mla":  # the heads' outputs out of latent space first (target/packed_mla.py)
        w_uv, *weights = weights
        attn_out = latent_output(attn_out, w_uv)
    wo, bo, ln2_w, *mlp = weights
    x = x + F.linear(attn_out, wo, bo)
    h = rms_norm(x, ln2_w, eps)
    if top_k:
        router_w, router_b, gate_up, down, shared_g, shared_u, shared_d = mlp
        out = moe_mlp(h, router_w, gate_up, down, router_b, top_k=top_k, **routing)
        if shared_g is not None:  # GLM-4.5's and ERNIE 4.5's shared experts: (weight, bias) each
            out = out + gated_mlp(h, shared_g, shared_u, shared_d)
        return x + out
    wg, bg, wu, bu, wd, bd = mlp
    return x + gated_mlp(h, (wg, bg), (wu, bu), (wd, bd))


def final_logits(h: Tensor, norm_w: Tensor, lm_head_w: Tensor, lm_head_b: Tensor | None, *, eps: float,
                 kind: LayerKind = "llama", softcap: float | None = None) -> Tensor:
    """The final norm and the LM head; Gemma 2's logits soft-capped (cap * tanh(logits / cap))."""
    return soft_cap(F.linear(norm(h, norm_w, eps, kind), lm_head_w, lm_head_b), softcap)


def eps_of(norm_module: nn.Module) -> float:
    return float(getattr(norm_module, "variance_epsilon", getattr(norm_module, "eps", 1e-6)))


def mlp_laid_out_as_expected(mlp: nn.Module, kind: LayerKind) -> bool:
    """Experts stored as transformers 5 stores them (3D tensors), where the layer has experts."""
    if kind == "gpt_oss":
        return experts_as_gpt_oss_stores_them(mlp)
    if kind == "hybrid" and hasattr(mlp, "experts"):
        return experts_with_gated_shared_expert(mlp)
    return not hasattr(mlp, "experts") or experts_as_tensors(mlp)


class LayerWeights:
    """References to one decoder layer's weights (no copies), grouped as the arguments of
    `pre_attention` / `post_attention`, with its RoPE table's name (`rope`: target/language_model.py
    `layer_rope_tables`; None: the model's one table), its sliding window (None: full attention) and its attention
    sinks (gpt-oss) beside them."""

    def __init__(self, layer: nn.Module, kind: LayerKind, rope: str | None, window: int | None) -> None:
        attn = layer.self_attn
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        ln1 = getattr(layer, "input_layernorm", None)  # (OLMo 2 has none: it norms after attention)
        self.ln1_eps = eps_of(ln1) if ln1 is not None else 0.0
        self.qk_eps = eps_of(q_norm) if q_norm is not None else 0.0
        self.pre_options: dict = {}  # latent attention's own (its eps is ln1_eps)
        if kind == "mla":
            self.pre, options = latent_weights(layer, self.ln1_eps)
            self.pre_options = {k: v for k, v in options.items() if k != "eps"}
        else:
            if attn.config.model_type in PAIRED_ROPE_MODEL_TYPES:  # ERNIE 4.5 (target/ops.py)
                self.pre_options = {"paired_rope": True}
            self.pre = (
                ln1.weight if ln1 is not None else None,
                *(t for linear, rows in attention_projections(attn) for t in projection_of(linear, rows)),  # q, k, v
                q_norm.weight if q_norm is not None else None,
                k_norm.weight if k_norm is not None else None,
            )  # fmt: skip
        self.kind, self.window, self.sinks = kind, window, getattr(attn, "sinks", None)
        self.rope = rope
        self.post, self.post_kw = _post_weights(layer, kind)


def _post_weights(layer: nn.Module, kind: LayerKind) -> tuple[tuple[Tensor | None, ...], dict]:
    """The layer's `post_attention` arguments and options: Gemma's, gpt-oss's and OLMo 2's as the packed
    forward groups them (target/packed_gemma.py, target/packed_gpt_oss.py, target/packed_olmo2.py)."""
    if kind == "mla":  # W_uv first, then the llama kind's output projection and MLP
        post, options = _post_weights(layer, "llama")
        return (up_projections(layer.self_attn)[1], *post), {**options, "kind": "mla"}
    if kind != "llama":
        packed = GemmaLayerWeights(layer, None, None) if kind == "gemma" else \
            GptOssLayerWeights(layer, None) if kind == "gpt_oss" else \
            Olmo2LayerWeights(layer, scale_in_float32=kind == "olmo2")
        return tuple(packed.post), {**packed.post_kwargs, "kind": kind}
    attn, mlp = layer.self_attn, layer.mlp
    eps = eps_of(layer.post_attention_layernorm)
    head = (attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight)
    experts = getattr(mlp, "experts", None)
    if experts is not None:  # Qwen3-MoE, GLM-4.5: the router and the experts' 3D tensors (target/moe.py)
        shared = getattr(mlp, "shared_experts", None)
        shared_w = tuple(projection_of(m) for m in (shared.gate_proj, shared.up_proj, shared.down_proj)) \
            if shared is not None else (None, None, None)
        return (*head, mlp.gate.weight, router_bias(mlp), experts.gate_up_proj, experts.down_proj, *shared_w), \
            {"eps": eps, **routing_of(mlp)}
    gate_up = (t for linear, rows in mlp_projections(mlp) for t in projection_of(linear, rows))
    return (*head, *gate_up, mlp.down_proj.weight, mlp.down_proj.bias), {"eps": eps}

