"""The target forward on packed rows (`target.forward: packed`): our own layer loop over the
Hugging Face model's weight tensors (nothing is copied), with shapes fixed by the packed
batch, so that it can be compiled (`target.compile`).

One decoder layer is three calls:

    pre_attention    norm, q/k/v projections, Qwen3's q/k norms, RoPE, k/v repeated to the
                     query heads (per token: sees only the packed [R, S] shape)
    attention        F.scaled_dot_product_attention under `target.sdpa_backend`, eager, or
                     compiled FlexAttention (`target.document_attention: flex`)
    post_attention   output projection, residual, norm, gated MLP, residual (per token)

With `target.compile` the two per-token functions are torch.compile'd once per process
(weights are arguments, so all layers share one graph per shape). With `target.fp8` the
projections read `FP8Linear`'s float8 buffers and quantise each shared input once
(`quantize_rows`, `fp8_matmul`): compiled, that quantisation fuses into the norm / SiLU
kernels that produce the input. The uncompiled functions are the same code and run on the
CPU (tests compare them with the Hugging Face forward).

Documents: when every real token sits at its own column index (each row one document from
column 0, padding after it) attention is plain causal attention over the whole row, which
is exactly each document's own causal attention. Otherwise attention alone gathers every
document into a right-padded [D, L] batch (target/documents.py), runs causal attention there
and gathers the result back; everything else is per token, so it never sees D or L.
With `target.document_attention: flex` attention instead runs on the packed rows themselves
under a block mask that lets each token see its own document's earlier tokens
(utils/flex_masks.py): the tiles off the documents' diagonal blocks are skipped, and nothing is
gathered or scattered.

The forward stops after the last tapped layer when the final norm is not needed (`data`
labels); with `target`/`distill` labels it ends with the final norm (no LM head).

A target sharded over a group of ranks with FSDP2 (target/sharded.py) holds 1/G of each weight:
the forward gathers each module's weights while it reads them, the decoder layers one ahead
(target/gathered.py), and otherwise runs as on a whole target.

Supported: Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, GLM-4.5, MiniMax-M2, ERNIE 4.5 (RoPE over
neighbouring pairs), Phi-3, SmolLM3 (every fourth layer without RoPE) and Seed-OSS decoders: pre-norm RMSNorm blocks, GQA, optional q/k RMSNorm
(per head, or over the whole projection), optional biases, a SiLU-gated MLP or a mixture of
SiLU-gated experts (target/moe.py: one grouped GEMM for all experts; GLM's sigmoid router and
shared experts), static RoPE (over part of a head too); Phi-3's fused q/k/v and gate/up
projections are read as row blocks (target/language_model.py). Gemma 2/3 text stacks, also
inside a multimodal Gemma 3 checkpoint (target/packed_gemma.py); OLMo 2 and EXAONE 4
(target/packed_olmo2.py: norms after attention and the MLP, q/k norms; EXAONE's global layers
without RoPE); gpt-oss
(target/packed_gpt_oss.py: sinks, biased experts); DeepSeek-V3 and GLM-4.7-Flash (target/packed_mla.py:
latent attention, GLM's router); the hybrids Qwen3-Next and Qwen3.5 (target/packed_hybrid.py: their
linear-attention modules on the gathered documents, gated attention, gated shared experts).
Sliding-window layers (Mistral's and Mixtral's window, Qwen2/3's `use_sliding_window`, Gemma's
and gpt-oss's local layers) attend through FlexAttention under a windowed causal-within-document
block mask. Anything else is refused (use `target.forward: hf`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_train.target.documents import DocumentLayout
from dflash_train.target.gathered import gathered, layers_gathered, unsharded_type
from dflash_train.target.language_model import (PAIRED_ROPE_MODEL_TYPES, attention_projections, first_attention,
                                                 language_model, layer_rope_tables, layer_windows, mlp_projections,
                                                 rope_table, rope_types, text_config)
from dflash_train.target.moe import experts_as_tensors, moe_mlp, router_bias, routing_of
from dflash_train.target.packed_gpt_oss import (
    GptOssLayerWeights,
    experts_as_gpt_oss_stores_them,
    post_attention_gpt_oss,
    pre_attention_gpt_oss,
    sink_attention_scale,
)
from dflash_train.target.packed_gemma import (
    GEMMA_MODEL_TYPES,
    GemmaLayerWeights,
    gemma_rms_norm,
    soft_capped,
    post_attention_gemma,
    pre_attention_gemma,
)
from dflash_train.target.ops import apply_rope, keys_for_attention, normed_qk, rms_norm
from dflash_train.target.packed_hybrid import (
    HYBRID_MODEL_TYPES,
    HybridLayerWeights,
    experts_with_gated_shared_expert,
    linear_attention,
    post_attention_hybrid,
    post_mixer_hybrid,
    pre_attention_gated,
    zero_centred_norm,
)
from dflash_train.target.packed_mla import MLA_MODEL_TYPES, mla_attention_weights, pre_attention_mla, values_only
from dflash_train.target.packed_olmo2 import Olmo2LayerWeights, post_attention_olmo2, pre_attention_olmo2
from dflash_train.target.projections import Projection, gated_mlp, project, projection_of
from dflash_train.target.quantized import stays_quantized
from dflash_train.target.sdpa import sdpa_backend
from dflash_train.utils.compile import compiled_once
from dflash_train.utils.flex_masks import LSE_REQUEST, causal_document_block_mask, output_and_lse

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "phi3", "olmo2",
                         "smollm3", "seed_oss", "minimax_m2", "exaone4", "ernie4_5_moe", *GEMMA_MODEL_TYPES,
                         "gpt_oss", *MLA_MODEL_TYPES, *HYBRID_MODEL_TYPES)
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")



class UnsupportedTarget(ValueError):
    """The packed forward cannot reproduce this model (the message says why)."""


_HINT = "; use target.forward: hf for this model"


def check_packed_config(cfg) -> None:
    """Raise UnsupportedTarget unless a model of this Hugging Face config is one `PackedForward`
    reproduces, judged from the config alone (before the model loads); a multimodal checkpoint
    (Gemma 3) by its text decoder's config: text is all the drafter's data holds."""
    quantized = stays_quantized(cfg)
    cfg = text_config(cfg)
    model_type = getattr(cfg, "model_type", None)
    if quantized:
        raise UnsupportedTarget(f"a {quantized}-quantized checkpoint: the packed forward reads plain weights{_HINT}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedTarget(f"the packed target forward supports {', '.join(SUPPORTED_MODEL_TYPES)} "
                                f"decoders, not {model_type!r}{_HINT}")
    gemma = model_type in GEMMA_MODEL_TYPES
    act = getattr(cfg, "hidden_activation" if gemma else "hidden_act", None) or "silu"
    if act != ("gelu_pytorch_tanh" if gemma else "silu") and not (not gemma and act == "swish"):
        raise UnsupportedTarget(f"activation {act!r} is not supported{_HINT}")  # (gpt-oss's experts: their own)
    if rope_types(cfg) & set(_DYNAMIC_ROPE_TYPES):
        raise UnsupportedTarget(f"RoPE that depends on the sequence length is not supported{_HINT}")
    if gemma and (getattr(cfg, "attention_bias", False) or getattr(cfg, "use_bidirectional_attention", False)
                  or (model_type == "gemma3_text" and getattr(cfg, "attn_logit_softcapping", None))):
        raise UnsupportedTarget(f"Gemma attention with biases, bidirectional masks or (Gemma 3) soft-capped "
                                f"scores is not supported{_HINT}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise UnsupportedTarget(f"attention heads must be a multiple of kv heads{_HINT}")


def check_packed_support(model: nn.Module) -> None:
    """Raise UnsupportedTarget unless `PackedForward` computes exactly the model's own forward."""
    check_packed_config(model.config)
    cfg, inner = text_config(model.config), language_model(model)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise UnsupportedTarget(f"unexpected module layout of {type(model).__name__}{_HINT}")
    scaled = cfg.model_type in GEMMA_MODEL_TYPES and hasattr(inner.embed_tokens, "embed_scale")
    if unsharded_type(inner.embed_tokens) is not nn.Embedding and not scaled:  # a kind not reproduced
        raise UnsupportedTarget(f"embedding {unsharded_type(inner.embed_tokens).__name__} is not supported{_HINT}")
    laid_out = experts_as_gpt_oss_stores_them if cfg.model_type == "gpt_oss" else \
        experts_with_gated_shared_expert if cfg.model_type in HYBRID_MODEL_TYPES else experts_as_tensors
    if not all(laid_out(layer.mlp) for layer in inner.layers if hasattr(layer.mlp, "experts")):
        raise UnsupportedTarget(f"experts laid out other than as transformers 5 stores them (a router `gate` "
                                f"and 3D gate_up_proj / down_proj; shared experts as plain gated MLPs){_HINT}")


def pre_attention(
    x: Tensor, cos: Tensor, sin: Tensor, ln1_w: Tensor, q_p: Projection, k_p: Projection, v_p: Projection,
    qn_w: Tensor | None, kn_w: Tensor | None, *, eps: float, qk_eps: float, n_heads: int, n_kv: int, head_dim: int,
    paired_rope: bool = False, grouped_kv: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """x [R, S, H] -> q, k, v [R, S, n_heads, head_dim] (k/v repeated over each GQA group; `grouped_kv`:
    [R, S, n_kv, head_dim]), normed and rotated (`paired_rope`: ERNIE 4.5's, target/ops.py); `cos`/`sin`
    [R, S, 1, head_dim]."""
    h = rms_norm(x, ln1_w, eps)
    R, S = h.shape[:2]
    q, k, v = project(h, (q_p, k_p, v_p))
    q, k = normed_qk(q, k, qn_w, kn_w, lambda t, w: rms_norm(t, w, qk_eps), n_heads=n_heads, n_kv=n_kv,
                     head_dim=head_dim)  # Qwen3: per head; MiniMax-M2: over the whole projection
    v = v.view(R, S, n_kv, head_dim)
    q, k = apply_rope(q, cos, sin, paired_rope), apply_rope(k, cos, sin, paired_rope)
    return (q, *keys_for_attention(k, v, n_heads, grouped_kv))


def post_attention(
    x: Tensor, attn_out: Tensor, o_p: Projection, ln2_w: Tensor, gate_p: Projection, up_p: Projection,
    down_p: Projection, *, eps: float,
) -> Tensor:  # fmt: skip
    """Output projection, residual, norm, gated MLP, residual: the rest of one decoder layer."""
    x = x + project(attn_out, (o_p,))[0]
    return x + gated_mlp(rms_norm(x, ln2_w, eps), gate_p, up_p, down_p)


def post_attention_moe(
    x: Tensor, attn_out: Tensor, o_p: Projection, ln2_w: Tensor, router_w: Tensor, router_b: Tensor | None,
    gate_up: Tensor, down: Tensor, shared_gate: Projection | None, shared_up: Projection | None,
    shared_down: Projection | None, *, eps: float, **routing,
) -> Tensor:  # fmt: skip
    """`post_attention` with a mixture of experts in place of the gated MLP (target/moe.py; `routing`
    from `routing_of`), plus GLM-4.5's shared experts, a gated MLP on the same input."""
    x = x + project(attn_out, (o_p,))[0]
    h = rms_norm(x, ln2_w, eps)
    out = moe_mlp(h, router_w, gate_up, down, router_b, **routing)
    if shared_gate is not None:
        out = out + gated_mlp(h, shared_gate, shared_up, shared_down)
    return x + out


def post_attention_mla(x: Tensor, attn_out: Tensor, *post: Tensor | Projection | None, n_heads: int, v_dim: int,
                       moe: bool, **options) -> Tensor:
    """`post_attention` (or `post_attention_moe`) of a latent-attention layer, the values' zero
    padding cut off the attention output first (target/packed_mla.py)."""
    rest = post_attention_moe if moe else post_attention
    return rest(x, values_only(attn_out, n_heads, v_dim), *post, **options)


def rows_hold_one_document(document_ids: Tensor, position_ids: Tensor) -> bool:
    """True when every real token's position is its column index: each row is one document
    starting at column 0 (padding after it), so causal attention over the row is exact."""
    cols = torch.arange(position_ids.shape[1], device=position_ids.device)
    return bool(((position_ids == cols) | (document_ids < 0)).all())


class _LayerWeights:
    """References to one decoder layer's weights, grouped as the arguments of the two functions."""

    def __init__(self, layer: nn.Module, latent: bool = False) -> None:
        """`latent`: the layer's attention is DeepSeek's latent attention (target/packed_mla.py)."""
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.ln1_eps = float(layer.input_layernorm.variance_epsilon)
        if latent:
            self.pre, self.pre_kwargs = mla_attention_weights(layer, self.ln1_eps)
        else:
            self.pre = (layer.input_layernorm.weight, *(projection_of(*p) for p in attention_projections(attn)),
                        q_norm.weight if q_norm is not None else None,
                        k_norm.weight if k_norm is not None else None)
            qk_eps = float(q_norm.variance_epsilon) if q_norm is not None else 0.0
            paired = attn.config.model_type in PAIRED_ROPE_MODEL_TYPES
            self.pre_kwargs = {"eps": self.ln1_eps, "qk_eps": qk_eps, **({"paired_rope": True} if paired else {})}
        experts = getattr(mlp, "experts", None)
        self.moe = experts is not None  # Qwen3-MoE, Mixtral, GLM-4.5: router + 3D experts; else a gated MLP
        if self.moe:
            shared = getattr(mlp, "shared_experts", None)
            shared_p = (*(projection_of(*p) for p in mlp_projections(shared)), projection_of(shared.down_proj)) \
                if shared is not None else (None, None, None)
            self.post = (projection_of(attn.o_proj), layer.post_attention_layernorm.weight, mlp.gate.weight,
                         router_bias(mlp), experts.gate_up_proj, experts.down_proj, *shared_p)
            self.moe_kwargs = routing_of(mlp)
        else:
            self.post = (projection_of(attn.o_proj), layer.post_attention_layernorm.weight,
                         *(projection_of(*p) for p in mlp_projections(mlp)), projection_of(mlp.down_proj))
            self.moe_kwargs = {}
        self.ln2_eps = float(layer.post_attention_layernorm.variance_epsilon)
        # how PackedForward calls this layer: which of its functions, with which options
        self.pre_fn = "pre_attention_mla" if latent else "pre_attention"
        self.post_fn = "post_attention_moe" if self.moe else "post_attention"
        self.post_kwargs = {"eps": self.ln2_eps, **self.moe_kwargs}
        if latent:
            self.post_fn = "post_attention_mla"
            self.post_kwargs.update(moe=self.moe, n_heads=int(attn.config.num_attention_heads),
                                    v_dim=self.pre_kwargs["v_dim"])
        self.layer_type, self.window = None, None  # the RoPE table's name and the window: set by _layer_weights
        kinds = {len(p) for p in (*self.pre, *self.post) if isinstance(p, tuple)}  # (projections are tuples)
        if len(kinds) != 1:
            raise UnsupportedTarget("a decoder layer mixes float8 and plain projections")


def _layer_weights(layer: nn.Module, cfg, window: int | None, rope: str | None) -> LayerWeights:
    """One layer's weights; `window` its sliding window, `rope` its RoPE table (`layer_rope_tables`)."""
    if cfg.model_type in HYBRID_MODEL_TYPES:
        return HybridLayerWeights(layer)
    if cfg.model_type in ("olmo2", "exaone4"):
        return Olmo2LayerWeights(layer, window, rope, scale_in_float32=cfg.model_type == "olmo2")
    if cfg.model_type == "gpt_oss":
        return GptOssLayerWeights(layer, window)
    if cfg.model_type in GEMMA_MODEL_TYPES:
        return GemmaLayerWeights(layer, rope, window)
    weights = _LayerWeights(layer, latent=cfg.model_type in MLA_MODEL_TYPES)
    weights.window, weights.layer_type = window, rope
    return weights


# the layer functions by name -> (function, whether it compiles as one graph: the experts' grouped GEMM
# may break the graph on some PyTorch builds, so functions that run experts are not fullgraph)
LAYER_FUNCTIONS: dict[str, tuple[Callable, bool]] = {
    "pre_attention": (pre_attention, True), "post_attention": (post_attention, True),
    "post_attention_moe": (post_attention_moe, False),
    "pre_attention_gemma": (pre_attention_gemma, True), "post_attention_gemma": (post_attention_gemma, True),
    "pre_attention_gpt_oss": (pre_attention_gpt_oss, True), "post_attention_gpt_oss": (post_attention_gpt_oss, False),
    "pre_attention_gated": (pre_attention_gated, True), "post_attention_hybrid": (post_attention_hybrid, False),
    "post_mixer_hybrid": (post_mixer_hybrid, False), "zero_centred_norm": (zero_centred_norm, True),
    "pre_attention_mla": (pre_attention_mla, True), "post_attention_mla": (post_attention_mla, False),
    "pre_attention_olmo2": (pre_attention_olmo2, True), "post_attention_olmo2": (post_attention_olmo2, True),
}

LayerWeights = _LayerWeights | GemmaLayerWeights | GptOssLayerWeights | Olmo2LayerWeights | HybridLayerWeights


class PackedForward:
    """Tapped hidden states (and final-normed states) of packed rows, per token in one shape."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], *, sdpa: str = "auto", compile: bool = False,
                 grouped_kv: bool = False):
        """`grouped_kv`: attention takes one key/value head per group of query heads (enable_gqa), not
        copies repeated to every query head (target.grouped_kv)."""
        check_packed_support(model)
        cfg, inner = text_config(model.config), language_model(model)  # a multimodal wrapper: its text stack
        self.gemma = cfg.model_type in GEMMA_MODEL_TYPES
        # a target sharded with FSDP2 (target/sharded.py): each module's weights are gathered while
        # they are read (target/gathered.py); the references below are then its shards, for shapes
        self.model, self.inner, self.cfg = model, inner, cfg
        # Gemma scales its embedding by sqrt(hidden), in the weights' dtype
        self.embed_scale = getattr(inner.embed_tokens, "embed_scale", None) if self.gemma else None
        self.rotary = inner.rotary_emb
        self.norm_eps = float(getattr(inner.norm, "variance_epsilon", getattr(inner.norm, "eps", 1e-6)))
        self.windows, self.ropes = layer_windows(cfg), layer_rope_tables(cfg)
        self.layers = [_layer_weights(layer, cfg, self.windows[i], self.ropes[i])
                       for i, layer in enumerate(inner.layers)]
        self.sharded = any(isinstance(m, FSDPModule) for m in (model, *inner.layers))
        self.layer_ids = list(layer_ids)
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        attn = first_attention(inner)
        self.head_dim = getattr(attn, "head_dim", None) or attn.qk_head_dim  # (latent attention: the keys' width)
        self.scale = float(attn.scaling)
        # hybrids' linear-attention layers read whole documents: they take the gathered layout
        self.linear_layers = any(getattr(lay, "mixer", None) is not None for lay in self.layers)
        self.window = next((lay.window for lay in self.layers if lay.window), None)
        self.sdpa = sdpa
        self.compile = compile
        self.grouped_kv = grouped_kv
        # what every layer calls, by the names its weights give (`pre_fn`, `post_fn`): the plain
        # functions, or their versions compiled once per process
        for name, (function, whole_graph) in LAYER_FUNCTIONS.items():
            setattr(self, name, compiled_once(function, fullgraph=whole_graph) if compile else function)
        # gpt-oss's sinks need FlexAttention's log-sum-exp, Gemma 2's soft-capped scores its
        # score_mod: every layer attends on the packed rows
        cap = getattr(cfg, "attn_logit_softcapping", None) if cfg.model_type == "gemma2" else None
        self.score_mod = soft_capped(float(cap)) if cap else None
        self.flex_every_layer = cfg.model_type == "gpt_oss" or self.score_mod is not None
        self.final_norm = gemma_rms_norm if self.gemma or cfg.model_type in HYBRID_MODEL_TYPES else \
            functools.partial(rms_norm, scale_in_float32=cfg.model_type in ("gpt_oss", "olmo2"))

    def layers_to_run(self, need_final: bool) -> int:
        """All layers with the final norm; otherwise up to the last tapped layer."""
        return len(self.layers) if need_final else max(self.layer_ids) + 1

    def attention(self, q: Tensor, k: Tensor, v: Tensor, layout: DocumentLayout | BlockMask | None,
                  sinks: Tensor | None = None) -> Tensor:
        """q [R, S, heads, D], k, v [R, S, heads or (grouped_kv) kv heads, D] -> [R, S, heads * D]: causal
        over each row (`layout` None), over each document gathered by `layout` (target/documents.py), or
        under the causal-within-document BlockMask of the packed rows (document_attention flex; sliding
        windows); `sinks` [heads]: gpt-oss's sink logits (a BlockMask only)."""
        R, S, h, d = q.shape
        gqa = {"enable_gqa": True} if self.grouped_kv else {}  # (asked only then: older kernels lack it)
        if isinstance(layout, BlockMask):
            # compiled on a GPU (eager FlexAttention builds every score); on a CPU compiling costs
            # tens of seconds a shape and cannot return the log-sum-exp: eager there
            flex = compiled_once(flex_attention, dynamic=None, fullgraph=False) if q.is_cuda else flex_attention
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if sinks is None:
                o = flex(q, k, v, block_mask=layout, scale=self.scale, score_mod=self.score_mod, **gqa)
                return o.transpose(1, 2).reshape(R, S, h * d)
            o, lse = output_and_lse(flex(q, k, v, block_mask=layout, scale=self.scale, score_mod=self.score_mod,
                                         **gqa, **LSE_REQUEST))
            return (o.transpose(1, 2) * sink_attention_scale(lse, sinks).to(o.dtype)).reshape(R, S, h * d)
        with sdpa_backend(self.sdpa):
            if layout is None:
                o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                   is_causal=True, scale=self.scale, **gqa)
                return o.transpose(1, 2).reshape(R, S, h * d)
            docs = [layout.docs(t).transpose(1, 2) for t in (q, k, v)]  # [D, heads, L, D_head]
            o = F.scaled_dot_product_attention(*docs, is_causal=True, scale=self.scale, **gqa)
            return layout.packed(o.transpose(1, 2)).reshape(R, S, h * d)

    @torch.no_grad()
    def __call__(self, input_ids: Tensor, position_ids: Tensor, document_ids: Tensor, *, need_final: bool,
                 layout: DocumentLayout | BlockMask | None) -> tuple[Tensor, Tensor | None]:
        """Packed [R, S] -> (taps [R, S, n*H] in `layer_ids` order, final [R, S, H] or None);
        padding positions are 0. `layout`: None when `rows_hold_one_document`, else the
        gather maps of `unpack_documents` or the flex BlockMask."""
        with gathered(self.model):  # the root's own weights (the final norm; a tied embedding)
            return self._forward(input_ids, position_ids, document_ids, need_final=need_final, layout=layout)

    def _forward(self, input_ids: Tensor, position_ids: Tensor, document_ids: Tensor, *, need_final: bool,
                 layout: DocumentLayout | BlockMask | None) -> tuple[Tensor, Tensor | None]:
        R, S = input_ids.shape
        with gathered(self.inner.embed_tokens) as embed:
            x = F.embedding(input_ids, embed.weight)
        if self.embed_scale is not None:
            x = x * self.embed_scale.to(x.dtype)
        H = x.shape[-1]
        ropes = self._rope_tables(x, position_ids)
        # sliding-window layers: causal within the document and the window, on the packed rows
        window_mask = causal_document_block_mask(document_ids, window=self.window) if self.window else None
        if self.flex_every_layer:
            layout = causal_document_block_mask(document_ids)
        taps = x.new_empty(R, S, len(self.layer_ids) * H)
        slots = {i: [j for j, t in enumerate(self.layer_ids) if t == i] for i in set(self.layer_ids)}
        with layers_gathered(self.inner.layers, self.layers_to_run(need_final)) as indices:
            for i in indices:
                lay = self.layers[i] if not self.sharded else \
                    _layer_weights(self.inner.layers[i], self.cfg, self.windows[i], self.ropes[i])
                x = self._layer(lay, x, ropes, layout, window_mask)
                for j in slots.get(i, ()):
                    taps[..., j * H:(j + 1) * H] = x
        pad = (document_ids < 0)[..., None]
        taps.masked_fill_(pad, 0)
        final = None
        if need_final:
            final = self.final_norm(x, self.inner.norm.weight, self.norm_eps).masked_fill_(pad, 0)
        return taps, final

    def _layer(self, lay: LayerWeights, x: Tensor, ropes: dict, layout: DocumentLayout | BlockMask | None,
               window_mask: BlockMask | None) -> Tensor:
        """One decoder layer: its token mixer, then the rest of the layer (norms, MLP, residuals)."""
        if getattr(lay, "mixer", None) is not None:  # a hybrid's linear attention (target/packed_hybrid.py)
            mixed = linear_attention(lay.mixer, self.zero_centred_norm(x, lay.ln1_w, lay.ln1_eps), layout)
            return self.post_mixer_hybrid(x, mixed, *lay.post, **lay.post_kwargs)
        q, k, v, *gate = getattr(self, lay.pre_fn)(x, *ropes[lay.layer_type], *lay.pre, **lay.pre_kwargs,
                                                   n_heads=self.n_heads, n_kv=self.n_kv, head_dim=self.head_dim,
                                                   grouped_kv=self.grouped_kv)
        attn = self.attention(q, k, v, window_mask if lay.window else layout, getattr(lay, "sinks", None))
        return getattr(self, lay.post_fn)(x, attn, *gate, *lay.post, **lay.post_kwargs)  # (gate: hybrids' attention)

    def _rope_tables(self, x: Tensor, position_ids: Tensor) -> dict[str | None, tuple[Tensor, Tensor]]:
        """(cos, sin) [R, S, 1, D] by table name, as the model's own forward computes them (Gemma 3's
        local and global layers rotate with different bases, SmolLM3's NoPE layers not at all; other
        families have one table)."""
        kinds = {lay.layer_type for lay in self.layers}
        tables = {kind: rope_table(self.rotary, x, position_ids, kind) for kind in kinds}
        if self.cfg.model_type == "gpt_oss":  # half-width tables, each half of a head rotated alike
            tables = {kind: (torch.cat([c, c], -1), torch.cat([s, s], -1)) for kind, (c, s) in tables.items()}
        return {kind: (cos[:, :, None, :], sin[:, :, None, :]) for kind, (cos, sin) in tables.items()}
