"""A compact decoder forward with a static per-slot KV cache, for the built-in engine.

It reads the Hugging Face model's own weight tensors (nothing is copied) and repeats the
Hugging Face op sequence for norms, rotary embeddings and MLP, so fp32 results match
`model.generate` token for token. Only attention and the cache are ours:

    k_cache, v_cache: [layers, slots, kv_heads, max_len, head_dim]

Every slot holds one conversation at its own position, so a finished slot can be refilled
by `prefill` while the others keep decoding. `decode` has a fixed shape for a given
`kv_len` (how many cache positions attention reads), which is what lets the engine
capture it in a CUDA graph.

Supported: Llama-family decoders (Llama, Mistral without a sliding window, Qwen2, Qwen3, and
Qwen3-MoE, whose experts run as one grouped GEMM: target/moe.py):
pre-norm RMSNorm blocks, GQA, optional q/k RMSNorm (Qwen3), optional qkv bias (Qwen2),
SiLU-gated MLP, any static RoPE variant transformers provides (default, linear, llama3,
yarn, ...), tied or untied lm_head.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_train.generate.attention import AttentionKind, CacheAttention, cache_index, causal_rule, flat, write_cache
from dflash_train.target.moe import experts_as_tensors, moe_mlp
from dflash_train.target.ops import apply_rope, rms_norm
from dflash_train.utils.errors import ModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")
# RoPE types whose frequencies depend on the current sequence length: a fixed table cannot
# reproduce them, so they go to the HTTP engine.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


class UnsupportedModelError(ModelError):
    """The built-in engine cannot run this model; the message points to the HTTP engine."""


def _rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(params.get("rope_type", params.get("type", "default")))


_HINT = "; use the HTTP engine (--engine http) with a vLLM or SGLang server for this model"


def check_supported_config(cfg, max_len: int) -> None:
    """Raise UnsupportedModelError unless a model of this config is one the engine reproduces,
    judged from the config alone: the refusal comes before any weight is loaded."""
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"the built-in engine supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not "
            f"{cfg.model_type!r}{_HINT}"
        )
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedModelError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu){_HINT}")
    rope = _rope_type(cfg)
    if rope in _DYNAMIC_ROPE_TYPES:
        raise UnsupportedModelError(f"rope type {rope!r} depends on the sequence length{_HINT}")
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None) or []
    sliding = "sliding_attention" in layer_types or (
        window is not None and getattr(cfg, "use_sliding_window", cfg.model_type == "mistral")
    )
    if sliding and window is not None and window < max_len:
        raise UnsupportedModelError(
            f"sliding-window attention (window {window} < {max_len} cache positions) is not supported{_HINT}"
        )
    if getattr(cfg, "partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"partial rotary embeddings are not supported{_HINT}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise UnsupportedModelError(f"attention heads must be a multiple of kv heads{_HINT}")


def check_supported(model, max_len: int) -> None:
    """Raise UnsupportedModelError unless `decode`/`prefill` reproduce `model` exactly."""
    check_supported_config(model.config, max_len)
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise UnsupportedModelError(f"unexpected module layout for {type(model).__name__}{_HINT}")
    if not all(experts_as_tensors(layer.mlp) for layer in inner.layers if hasattr(layer.mlp, "experts")):
        raise UnsupportedModelError(f"experts laid out other than as transformers 5 stores them{_HINT}")
    attn = inner.layers[0].self_attn
    head_dim = attn.head_dim
    if head_dim % 2:
        raise UnsupportedModelError(f"odd head_dim {head_dim} is not supported{_HINT}")
    mlp = next((layer.mlp for layer in inner.layers if not hasattr(layer.mlp, "experts")), None)
    dense = [mlp.gate_proj, mlp.up_proj, mlp.down_proj] if mlp is not None else []
    linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *dense]
    if not all(isinstance(m, torch.nn.Linear) for m in linears):
        # e.g. target.fp8's float8 layers: decoding with them would measure a target nobody serves
        raise UnsupportedModelError("the decoder's linear layers were replaced (target.fp8?): the engine decodes "
                                    "with the model's own bf16 weights; load the target without target.fp8")


def head_dim_of(model: torch.nn.Module) -> int | None:
    """The width of the attention heads of a decoder laid out as this module expects (None
    otherwise: `check_supported` says what is wrong)."""
    try:
        return int(model.model.layers[0].self_attn.head_dim)  # type: ignore[union-attr,index]
    except (AttributeError, IndexError, TypeError):
        return None


class _Layer:
    """References to one decoder layer's weights (no copies), grouped as the arguments of
    `_pre_attention` / `_post_attention`: plain tensors, so a torch.compile'd version of
    those functions is traced once and reused by every layer."""

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.pre: tuple[Tensor | None, ...] = (
            layer.input_layernorm.weight,
            attn.q_proj.weight, attn.q_proj.bias,
            attn.k_proj.weight, attn.k_proj.bias,
            attn.v_proj.weight, attn.v_proj.bias,
            q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None,
        )  # fmt: skip
        head = (attn.o_proj.weight, attn.o_proj.bias, layer.post_attention_layernorm.weight)
        self.ln1_eps = float(layer.input_layernorm.variance_epsilon)
        self.ln2_eps = float(layer.post_attention_layernorm.variance_epsilon)
        experts = getattr(mlp, "experts", None)
        if experts is not None:  # Qwen3-MoE: the router and the experts' 3D tensors (target/moe.py)
            self.post: tuple[Tensor | None, ...] = (*head, mlp.gate.weight, experts.gate_up_proj, experts.down_proj)
            self.post_kw = {"eps": self.ln2_eps, "top_k": int(mlp.gate.top_k),
                            "renormalise": bool(mlp.gate.norm_topk_prob)}
        else:
            self.post = (*head, mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias,
                         mlp.down_proj.weight, mlp.down_proj.bias)
            self.post_kw = {"eps": self.ln2_eps}
        self.qk_eps = float(q_norm.variance_epsilon) if q_norm is not None else 0.0


def _pre_attention(
    x: Tensor, cos: Tensor, sin: Tensor,
    ln1_w: Tensor, wq: Tensor, bq: Tensor | None, wk: Tensor, bk: Tensor | None,
    wv: Tensor, bv: Tensor | None, qn_w: Tensor | None, kn_w: Tensor | None,
    *, eps: float, qk_eps: float, n_heads: int, n_kv: int, head_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """x [..., H] -> q [..., n_heads, D], k/v [..., n_kv, D], normed and rotated.

    `cos`/`sin` must broadcast against [..., heads, D] (a heads axis of size 1)."""
    h = rms_norm(x, ln1_w, eps)
    lead = h.shape[:-1]
    q = F.linear(h, wq, bq).view(*lead, n_heads, head_dim)
    k = F.linear(h, wk, bk).view(*lead, n_kv, head_dim)
    v = F.linear(h, wv, bv).view(*lead, n_kv, head_dim)
    if qn_w is not None and kn_w is not None:  # Qwen3: RMSNorm over head_dim before RoPE
        q = rms_norm(q, qn_w, qk_eps)
        k = rms_norm(k, kn_w, qk_eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _q_writing_kv(
    x: Tensor, cos: Tensor, sin: Tensor, *pre: Tensor | None, k_flat: Tensor, v_flat: Tensor, index: Tensor,
    eps: float, qk_eps: float, n_heads: int, n_kv: int, head_dim: int,
) -> Tensor:  # fmt: skip
    """`_pre_attention` that writes k/v into the cache (flat views, at `index`: generate/attention.py)
    and returns q: compiled, the writes fuse into the kernels computing k and v."""
    q, k, v = _pre_attention(x, cos, sin, *pre, eps=eps, qk_eps=qk_eps, n_heads=n_heads, n_kv=n_kv, head_dim=head_dim)
    write_cache(k_flat, index, k)
    write_cache(v_flat, index, v)
    return q


def _post_attention(
    x: Tensor, attn_out: Tensor, wo: Tensor, bo: Tensor | None, ln2_w: Tensor, *mlp: Tensor | None,
    eps: float, top_k: int = 0, renormalise: bool = False,
) -> Tensor:  # fmt: skip
    """Output projection, residual adds and the MLP: the rest of one decoder layer. `mlp` is a
    gated MLP's (wg, bg, wu, bu, wd, bd), or with `top_k` a mixture of experts' (router, gate_up,
    down): a layer kind is a fixed argument count, so a compiled version traces each kind once."""
    x = x + F.linear(attn_out, wo, bo)
    h = rms_norm(x, ln2_w, eps)
    if top_k:
        router_w, gate_up, down = mlp
        return x + moe_mlp(h, router_w, gate_up, down, top_k=top_k, renormalise=renormalise)
    wg, bg, wu, bu, wd, bd = mlp
    return x + F.linear(F.silu(F.linear(h, wg, bg)) * F.linear(h, wu, bu), wd, bd)


def _final_logits(h: Tensor, norm_w: Tensor, lm_head_w: Tensor, lm_head_b: Tensor | None, *, eps: float) -> Tensor:
    return F.linear(rms_norm(h, norm_w, eps), lm_head_w, lm_head_b)


class StaticDecoder:
    """Static-cache forward for `slots` concurrent sequences of at most `max_len` tokens."""

    def __init__(self, model, slots: int, max_len: int, attention: AttentionKind = "dense") -> None:
        check_supported(model, max_len)
        cfg = model.config
        inner = model.model
        self.embed_w = inner.embed_tokens.weight
        self.norm_w, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head_w = model.get_output_embeddings().weight  # the embedding itself when tied
        self.lm_head_b = getattr(model.get_output_embeddings(), "bias", None)
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = head_dim_of(model)
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.slots, self.max_len = slots, max_len
        self.dtype, self.device = self.embed_w.dtype, self.embed_w.device

        shape = (len(self.layers), slots, self.n_kv, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        # The model's own rotary module computes the table, so every static RoPE scaling
        # (linear, llama3, yarn, ...) and its attention factor come out exactly as in HF.
        positions = torch.arange(max_len, device=self.device)
        with torch.no_grad():
            cos, sin = inner.rotary_emb(torch.empty(0, dtype=self.dtype, device=self.device), positions[None])
        self.cos, self.sin = cos[0].contiguous(), sin[0].contiguous()  # [max_len, D]
        self.key_positions = positions
        self.rows = torch.arange(slots, device=self.device)
        # The per-layer pieces `decode` calls; the engine may swap in torch.compile'd versions.
        self.pre_attention: Callable[..., tuple[Tensor, Tensor, Tensor]] = _pre_attention
        self.q_writing_kv: Callable[..., Tensor] = _q_writing_kv  # of `verify`
        self.k_flat = [flat(c) for c in self.k_cache]  # per layer [slots * kv * max_len, D] views
        self.v_flat = [flat(c) for c in self.v_cache]
        self.post_attention: Callable[..., Tensor] = _post_attention
        self.final_logits: Callable[..., Tensor] = _final_logits  # of `verify` (fixed shapes: compilable)
        self.attention_kind = attention  # of `verify` (generate/attention.py)
        self._attentions: dict[tuple[int, int], CacheAttention] = {}

    def _attention(self, slots: int, width: int) -> CacheAttention:
        """The causal cache attention of `verify` for `width` tokens per slot (its mask buffers
        are made on the first call: a warm-up, never inside a CUDA-graph capture)."""
        key = (slots, width)
        if key not in self._attentions:
            self._attentions[key] = CacheAttention(
                causal_rule, self.attention_kind, slots=slots, q_len=width, max_len=self.max_len,
                n_heads=self.n_heads, n_kv=self.n_kv, head_dim=self.head_dim, scale=self.scale, dtype=self.dtype,
                device=self.device)
        return self._attentions[key]

    def _pre_kw(self, lay: _Layer) -> dict:
        return {"eps": lay.ln1_eps, "qk_eps": lay.qk_eps, "n_heads": self.n_heads, "n_kv": self.n_kv, "head_dim": self.head_dim}

    def kv_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def _logits(self, h: Tensor) -> Tensor:
        return _final_logits(h, self.norm_w, self.lm_head_w, self.lm_head_b, eps=self.norm_eps)

    def prefill(self, ids: Tensor, lengths: Tensor, slot_ids: Tensor) -> Tensor:
        """Run right-padded prompts `ids` [B, T] into the cache rows `slot_ids` [B].

        Returns the logits [B, V] after each prompt's last token. Causal attention over a
        right-padded batch never lets a real token see padding, so no padding mask is needed;
        the cache entries written for padding are never read (decode masks by position)."""
        return self._prefill(ids, lengths, slot_ids, ())[0]

    def prefill_with_taps(
        self, ids: Tensor, lengths: Tensor, slot_ids: Tensor, tap_layers: Sequence[int]
    ) -> tuple[Tensor, Tensor]:
        """`prefill`, also returning the taps [B, T, n*H] of every position: the outputs of
        decoder layers `tap_layers` (pre final norm, HF `hidden_states[l + 1]`), concatenated
        in that order. Rows past a prompt's length hold padding garbage."""
        logits, taps = self._prefill(ids, lengths, slot_ids, tap_layers)
        assert taps is not None, "tap_layers must name at least one layer"
        return logits, taps

    def _prefill(
        self, ids: Tensor, lengths: Tensor, slot_ids: Tensor, tap_layers: Sequence[int]
    ) -> tuple[Tensor, Tensor | None]:
        b, t = ids.shape
        x = F.embedding(ids, self.embed_w)
        cos, sin = self.cos[:t, None, :], self.sin[:t, None, :]  # [T, 1, D] over [B, T, heads, D]
        rep = self.n_heads // self.n_kv
        taps: dict[int, Tensor] = {}
        for i, lay in enumerate(self.layers):
            q, k, v = _pre_attention(x, cos, sin, *lay.pre, **self._pre_kw(lay))
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv, T, D]
            self.k_cache[i, slot_ids, :, :t] = k
            self.v_cache[i, slot_ids, :, :t] = v
            if rep > 1:  # same as transformers' repeat_kv
                k = k[:, :, None].expand(b, self.n_kv, rep, t, self.head_dim).reshape(b, self.n_heads, t, self.head_dim)
                v = v[:, :, None].expand(b, self.n_kv, rep, t, self.head_dim).reshape(b, self.n_heads, t, self.head_dim)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, is_causal=True, scale=self.scale)
            x = _post_attention(x, o.transpose(1, 2).reshape(b, t, -1), *lay.post, **lay.post_kw)
            if i in tap_layers:
                taps[i] = x
        last = x[torch.arange(b, device=x.device), lengths - 1]
        return self._logits(last), self._concat_taps(taps, tap_layers)

    @staticmethod
    def _concat_taps(taps: dict[int, Tensor], tap_layers: Sequence[int], out: Tensor | None = None) -> Tensor | None:
        if not tap_layers:
            return None
        return torch.cat([taps[i] for i in tap_layers], dim=-1, out=out)

    def decode(self, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """One token for every slot: tokens/positions [slots] -> logits [slots, V].

        Fixed shapes for a given `kv_len` and no host synchronisation: safe to capture in a
        CUDA graph. Attention reads cache positions [0, kv_len) of each slot, masked to
        positions <= the slot's own; the caller guarantees max(positions) < kv_len. With
        `attention_kind` flex it is `verify` of one token per slot, which reads every slot's
        cache only up to its own position (by 128-key blocks) whatever `kv_len`."""
        if self.attention_kind == "flex":  # each slot reads only its own 128-key blocks
            return self.verify(tokens[:, None], positions, kv_len)[0][:, 0]
        s, rep = self.slots, self.n_heads // self.n_kv
        x = F.embedding(tokens, self.embed_w)  # [S, H]
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]  # [S, 1, D]
        visible = (self.key_positions[None, :kv_len] <= positions[:, None])[:, None, None, :]  # [S,1,1,L]
        for i, lay in enumerate(self.layers):
            q, k, v = self.pre_attention(x, cos, sin, *lay.pre, **self._pre_kw(lay))
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[self.rows, :, positions] = k
            vc[self.rows, :, positions] = v
            # GQA without repeating the cache: the `rep` query heads sharing a kv head become
            # that head's `rep` query rows (all at the same position, so one mask serves all).
            o = F.scaled_dot_product_attention(
                q.view(s, self.n_kv, rep, self.head_dim),
                kc[:, :, :kv_len],
                vc[:, :, :kv_len],
                attn_mask=visible,
                scale=self.scale,
            )
            x = self.post_attention(x, o.reshape(s, self.n_heads * self.head_dim), *lay.post, **lay.post_kw)
        return self._logits(x)

    def verify(
        self, tokens: Tensor, positions: Tensor, kv_len: int, tap_layers: Sequence[int] = (),
        taps_out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """T tokens for every slot: tokens [S, T] at positions[s] + 0..T-1 (positions [S]).

        Returns logits [S, T, V] and, if `tap_layers` names any, the taps [S, T, n*H]
        (outputs of those decoder layers, pre final norm), written into `taps_out` if given.
        The tokens' K/V are written into
        the cache at their positions; each query attends to the slot's cache positions
        <= its own, so entries a slot wrote earlier beyond its committed length (rejected
        drafts) are never read, and this call overwrites them. Like `decode`: fixed shapes
        for a given `kv_len`, no host synchronisation, safe to capture in a CUDA graph; the
        caller guarantees max(positions) + T <= kv_len <= max_len. The attention kernel is
        `attention_kind` (generate/attention.py: `flex` reads the whole cache, by blocks)."""
        s, t = tokens.shape
        grid = positions[:, None] + self.key_positions[None, :t]  # [S, T] each token's position
        x = F.embedding(tokens, self.embed_w)  # [S, T, H]
        cos, sin = self.cos[grid][:, :, None, :], self.sin[grid][:, :, None, :]  # [S, T, 1, D]
        attention = self._attention(s, t)
        attention.prepare(positions, kv_len)  # once for all layers
        index = cache_index(self.rows[:s], grid, self.n_kv, self.max_len)  # (s, t, j) -> row s, head j, grid[s, t]
        taps: dict[int, Tensor] = {}
        for i, lay in enumerate(self.layers):
            q = self.q_writing_kv(x, cos, sin, *lay.pre, k_flat=self.k_flat[i], v_flat=self.v_flat[i], index=index,
                                  **self._pre_kw(lay))  # q [S, T, h, D]; k/v into the cache
            x = self.post_attention(x, attention.attend(q, self.k_cache[i], self.v_cache[i]), *lay.post,
                                    **lay.post_kw)
            if i in tap_layers:
                taps[i] = x
        return self.final_logits(x, self.norm_w, self.lm_head_w, self.lm_head_b, eps=self.norm_eps), \
            self._concat_taps(taps, tap_layers, taps_out)
