"""A compact decoder forward with a static per-slot KV cache, for the built-in engine.

It reads the Hugging Face model's own weight tensors (nothing is copied) and repeats the
Hugging Face op sequence for norms, rotary embeddings and MLP (generate/layers.py), so fp32
results match `model.generate` token for token. Only attention and the cache are ours:

    k_caches[L], v_caches[L]: [layers of cache length L, slots, kv_heads, L, head_dim]
    (L = max_len, and for sliding-window layers a ring of W + 2B positions where shorter)

Every slot holds one conversation at its own position, so a finished slot can be refilled
by `prefill` while the others keep decoding. `decode` has a fixed shape for a given
`kv_len` (how many cache positions attention reads), which is what lets the engine
capture it in a CUDA graph.

Supported: Llama-family decoders (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, whose experts run as
one grouped GEMM: target/moe.py; SmolLM3, some layers without RoPE; Seed-OSS; MiniMax-M2), Gemma 2
and Gemma 3 (text, or the text decoder of the multimodal model), gpt-oss, and latent attention
(DeepSeek-V3, GLM-4.7-Flash: the latent cached as one head, target/packed_mla.py); any static RoPE variant transformers provides (default, linear,
llama3, yarn, ...), Gemma 3's table per layer type (`layer_rope_tables`), tied or untied lm_head. A sliding-window
layer keeps a ring of its last W + 2B positions (W its window, B the widest block `verify` takes;
generate/attention.py `ring_rule`) where that is shorter than the cache, so a rejected draft is
still rolled back by position alone, as in full layers, and the mask applies the window. Gemma 2's
soft-capped attention scores and gpt-oss's attention sinks attend through an explicit softmax.
The hybrids Qwen3-Next and Qwen3.5 take a subclass with linear-attention states beside the cache
(generate/hybrid_decoder.py; `static_decoder` picks the class).
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_train.generate.attention import (AttentionKind, CacheAttention, Rule, cache_index, causal_rule, flat,
                                             masked_attention, ring_length, ring_rule, windowed_rule)
from dflash_train.generate.linear_state import mixer_layout_problem
from dflash_train.generate.layers import (LayerWeights, eps_of, final_logits, layer_kind, mlp_laid_out_as_expected,
                                          post_attention, pre_attention, q_writing_kv)
from dflash_train.target.language_model import (attention_projections, final_logit_softcap, first_attention,
                                                 language_model, layer_rope_tables, layer_windows, mlp_projections,
                                                 rope_table, rope_types, text_config)
from dflash_train.target.moe import grouped_mm_syncs
from dflash_train.target.packed_hybrid import HYBRID_MODEL_TYPES
from dflash_train.target.packed_mla import MLA_MODEL_TYPES, latent_head_dim
from dflash_train.target.quantized import stays_quantized
from dflash_train.utils.errors import ModelError

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "glm4_moe", "phi3", "olmo2",
                         "smollm3", "seed_oss", "minimax_m2", "exaone4", "ernie4_5_moe", "gemma2", "gemma3_text",
                         "gpt_oss", *MLA_MODEL_TYPES, *HYBRID_MODEL_TYPES)
# RoPE types whose frequencies depend on the current sequence length: a fixed table cannot
# reproduce them, so they go to the HTTP engine.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")
_ACTIVATIONS = {"llama": ("silu", "swish"), "gemma": ("gelu_pytorch_tanh",), "gpt_oss": ("silu", "swish"),
                "olmo2": ("silu", "swish"), "exaone4": ("silu", "swish"), "mla": ("silu", "swish"),
                "hybrid": ("silu", "swish")}


class UnsupportedModelError(ModelError):
    """The built-in engine cannot run this model; the message points to the HTTP engine."""


_HINT = "; use the HTTP engine (--engine http) with a vLLM or SGLang server for this model"


def check_supported_config(config) -> None:
    """Raise UnsupportedModelError unless a model of this config is one the engine reproduces,
    judged from the config alone: the refusal comes before any weight is loaded."""
    cfg = text_config(config)
    quantized = stays_quantized(config)
    if quantized:
        raise UnsupportedModelError(f"a {quantized}-quantized checkpoint: the built-in engine reads plain "
                                    f"weights{_HINT}")
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"the built-in engine supports {', '.join(SUPPORTED_MODEL_TYPES)} models, not "
            f"{cfg.model_type!r}{_HINT}"
        )
    kind = layer_kind(cfg.model_type)
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "silu")
    if act not in _ACTIVATIONS[kind]:
        raise UnsupportedModelError(f"hidden activation {act!r} is not supported here (only "
                                    f"{', '.join(_ACTIVATIONS[kind])}){_HINT}")
    dynamic = sorted(rope_types(cfg) & set(_DYNAMIC_ROPE_TYPES))
    if dynamic:
        raise UnsupportedModelError(f"rope type {dynamic[0]!r} depends on the sequence length{_HINT}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise UnsupportedModelError(f"attention heads must be a multiple of kv heads{_HINT}")
    known = {"full_attention", "sliding_attention", *(("linear_attention",) if kind == "hybrid" else ())}
    if set(getattr(cfg, "layer_types", None) or ()) - known:
        raise UnsupportedModelError(f"layer types {sorted(set(cfg.layer_types))} are not supported{_HINT}")


def check_supported(model) -> None:
    """Raise UnsupportedModelError unless `decode`/`prefill` reproduce `model` exactly."""
    check_supported_config(model.config)
    inner = language_model(model)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        raise UnsupportedModelError(f"unexpected module layout for {type(model).__name__}{_HINT}")
    kind = layer_kind(text_config(model.config).model_type)
    mixers = [layer.linear_attn for layer in inner.layers if hasattr(layer, "linear_attn")] if kind == "hybrid" else []
    problem = next((p for p in map(mixer_layout_problem, mixers) if p), None)
    if problem:
        raise UnsupportedModelError(f"{problem}{_HINT}")
    if not all(mlp_laid_out_as_expected(layer.mlp, kind) for layer in inner.layers):
        raise UnsupportedModelError(f"experts laid out other than as transformers 5 stores them{_HINT}")
    attn = first_attention(inner)
    head_dim = head_dim_of(model)
    if head_dim is None or head_dim % 2:
        raise UnsupportedModelError(f"odd head_dim {head_dim} is not supported{_HINT}")
    mlp = next((layer.mlp for layer in inner.layers if not hasattr(layer.mlp, "experts")), None)
    dense = [*(m for m, _ in mlp_projections(mlp)), mlp.down_proj] if mlp is not None else []
    if kind == "mla":
        names = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj")
        qkv = [m for m in (getattr(attn, n, None) for n in names) if m is not None]
    else:
        qkv = [m for m, _ in attention_projections(attn)]
    linears = [*qkv, attn.o_proj, *dense]
    if not all(isinstance(m, torch.nn.Linear) for m in linears):
        # e.g. target.fp8's float8 layers: decoding with them would measure a target nobody serves
        raise UnsupportedModelError("the decoder's linear layers were replaced (target.fp8?): the engine decodes "
                                    "with the model's own bf16 weights; load the target without target.fp8")


def head_dim_of(model: torch.nn.Module) -> int | None:
    """The width of the attention heads of a decoder laid out as this module expects, as its
    cache holds them (latent attention: the one shared head of latent and rotary key; None
    otherwise: `check_supported` says what is wrong)."""
    try:
        attn = first_attention(language_model(model))
        return latent_head_dim(attn) if hasattr(attn, "kv_lora_rank") else int(attn.head_dim)
    except (AttributeError, IndexError, TypeError, StopIteration):
        return None


class StaticDecoder:
    """Static-cache forward for `slots` concurrent sequences of at most `max_len` tokens."""

    def __init__(self, model, slots: int, max_len: int, attention: AttentionKind = "dense", width: int = 1) -> None:
        """`width`: the widest block `verify` is given (the speculative engine's block size), which
        sizes the sliding-window layers' rings."""
        check_supported(model)
        cfg, inner = text_config(model.config), language_model(model)
        self.kind = layer_kind(cfg.model_type)
        if self.kind == "hybrid" and type(self)._attention_layers is StaticDecoder._attention_layers:
            raise TypeError("a hybrid stack's decoder is generate/hybrid_decoder.py's (static_decoder builds it)")
        self.embed_w = inner.embed_tokens.weight
        # Gemma scales its embedding by sqrt(hidden), in the weights' dtype (the drafter reads embed_w unscaled)
        self.embed_scale = getattr(inner.embed_tokens, "embed_scale", None) if self.kind == "gemma" else None
        self.norm_w, self.norm_eps = inner.norm.weight, eps_of(inner.norm)
        self.lm_head_w = model.get_output_embeddings().weight  # the embedding itself when tied
        self.lm_head_b = getattr(model.get_output_embeddings(), "bias", None)
        self.layers = self._attention_layers(inner, cfg)  # the layers holding a KV cache
        # latent attention caches one head that every query head reads (target/packed_mla.py)
        self.n_heads, self.n_kv = cfg.num_attention_heads, 1 if self.kind == "mla" else cfg.num_key_value_heads
        self.head_dim = head_dim_of(model)
        self.scale = float(first_attention(inner).scaling)
        # Gemma 2 caps its attention scores (Gemma 3's forward ignores the field), Gemma its logits where
        # set; gpt-oss's layers carry sinks
        cap = getattr(cfg, "attn_logit_softcapping", None) if cfg.model_type == "gemma2" else None
        self.score_cap = float(cap) if cap else None
        logit_cap = final_logit_softcap(cfg)
        self.logits_kw = {"eps": self.norm_eps, **({"kind": self.kind} if self.kind != "llama" else {}),
                          **({"softcap": logit_cap} if logit_cap else {})}
        self.slots, self.max_len = slots, max_len
        self.dtype, self.device = self.embed_w.dtype, self.embed_w.device
        # a step whose experts' grouped GEMM reads its offsets on the host cannot be a CUDA graph
        self.capturable = not (any(hasattr(layer.mlp, "experts") for layer in inner.layers)
                               and grouped_mm_syncs(self.dtype, self.device))
        if not self.capturable and self.device.type == "cuda":
            log.warning("the experts' grouped GEMM in %s reads its group offsets on the host on this GPU, so decoding "
                        "runs without CUDA graphs (slower); a bfloat16 target on a Hopper or newer GPU keeps them",
                        str(self.dtype).removeprefix("torch."))

        self.width = width
        # each layer's cache length: max_len, or a sliding-window layer's ring where shorter
        self.cache_lens = [ring_length([lay.window], width, max_len, attention) or max_len for lay in self.layers]
        self.kinds = {(lay.window, n) for lay, n in zip(self.layers, self.cache_lens)}  # (window, cache length)
        self.k_layers, self.v_layers = self._allocate_caches()  # per layer [slots, kv, L, D] views
        self.key_positions = torch.arange(max_len, device=self.device)
        self.ropes = self._rope_tables(inner.rotary_emb)
        self.rows = torch.arange(slots, device=self.device)
        # The per-layer pieces `decode` calls; the engine may swap in torch.compile'd versions.
        self.pre_attention: Callable[..., tuple[Tensor, Tensor, Tensor]] = pre_attention
        self.q_writing_kv: Callable[..., Tensor] = q_writing_kv  # of `verify`
        self.k_flat = [flat(c) for c in self.k_layers]  # per layer [slots * kv * L, D] views
        self.v_flat = [flat(c) for c in self.v_layers]
        self.post_attention: Callable[..., Tensor] = post_attention
        self.final_logits: Callable[..., Tensor] = final_logits  # of `verify` (fixed shapes: compilable)
        self.attention_kind = attention  # of `verify` (generate/attention.py)
        self._attentions: dict[tuple[int, int, int | None, int], CacheAttention] = {}

    def _attention_layers(self, inner, cfg) -> list:
        """Every decoder layer's weights (a hybrid stack's decoder keeps its attention layers here)."""
        windows, ropes = layer_windows(cfg), layer_rope_tables(cfg)
        return [LayerWeights(layer, self.kind, ropes[i], windows[i]) for i, layer in enumerate(inner.layers)]

    def verify_functions(self) -> tuple[str, ...]:
        """The per-layer functions `verify` calls, which the engines may compile (q_writing_kv +
        the attention kernel + post_attention, then final_logits)."""
        return "q_writing_kv", "post_attention", "final_logits"

    def decode_functions(self) -> tuple[str, ...]:
        """The same for `decode`: dense decode is pre_attention + SDPA + post_attention; flex
        decode, `verify` of one token."""
        return self.verify_functions() if self.attention_kind == "flex" else ("pre_attention", "post_attention")

    def _allocate_caches(self) -> tuple[list[Tensor], list[Tensor]]:
        """One K and one V tensor per cache length, the layers' caches views of them."""
        k_layers: list[Tensor] = [torch.empty(0)] * len(self.layers)
        v_layers: list[Tensor] = [torch.empty(0)] * len(self.layers)
        self.k_caches, self.v_caches = {}, {}
        for length in sorted(set(self.cache_lens)):
            ids = [i for i, n in enumerate(self.cache_lens) if n == length]
            shape = (len(ids), self.slots, self.n_kv, length, self.head_dim)
            self.k_caches[length] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v_caches[length] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            for j, i in enumerate(ids):
                k_layers[i], v_layers[i] = self.k_caches[length][j], self.v_caches[length][j]
        return k_layers, v_layers

    def _rope_tables(self, rotary) -> dict[str | None, tuple[Tensor, Tensor]]:
        """(cos, sin) [max_len, D] by the layers' table names, from the model's own rotary module, so
        every static RoPE scaling (linear, llama3, yarn, ...) and its attention factor come out exactly
        as in HF (Gemma 3: one table per layer type; gpt-oss's half-width tables repeated twice, the
        same rotation as rotate_half; a partial rotary embedding's narrower tables as they are)."""
        positions, x = self.key_positions[None], torch.empty(0, dtype=self.dtype, device=self.device)
        tables = {}
        with torch.no_grad():
            for name in {lay.rope for lay in self.layers}:
                cos, sin = rope_table(rotary, x, positions, name)
                if self.kind == "gpt_oss":  # half-width tables, each half of a head rotated alike
                    cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
                tables[name] = (cos[0].contiguous(), sin[0].contiguous())
        return tables

    def _attention(self, slots: int, width: int, window: int | None, length: int) -> CacheAttention:
        """The causal cache attention of `verify` for `width` tokens per slot, cut to `window` keys
        for sliding-window layers, over caches of `length` positions (a ring when shorter than
        max_len). Its mask buffers are made on the first call: a warm-up, never inside a CUDA-graph
        capture."""
        key = (slots, width, window, length)
        if key not in self._attentions:
            ring = length < self.max_len
            self._attentions[key] = CacheAttention(
                self._rule(window, length, width), self.attention_kind, slots=slots, q_len=width, max_len=length,
                n_heads=self.n_heads, n_kv=self.n_kv, head_dim=self.head_dim, scale=self.scale, dtype=self.dtype,
                device=self.device, score_cap=self.score_cap, window=None if ring else window)
        return self._attentions[key]

    def _rule(self, window: int | None, length: int, width: int) -> Rule:
        """Which cache slots a query sees (generate/attention.py): causal, cut to a sliding `window`,
        over a ring where the cache `length` is shorter than max_len, for blocks of `width`."""
        rule = windowed_rule(window) if window else causal_rule
        return ring_rule(rule, length, width) if length < self.max_len else rule

    def _slots_of(self, positions: Tensor, length: int) -> Tensor:
        """Cache slots of sequence positions in a cache of `length`: themselves, or their ring slots."""
        return positions if length == self.max_len else torch.remainder(positions, length)

    def _embed(self, ids: Tensor) -> Tensor:
        x = F.embedding(ids, self.embed_w)
        return x if self.embed_scale is None else x * self.embed_scale.to(x.dtype)

    def _pre_kw(self, lay: LayerWeights) -> dict:
        return {"eps": lay.ln1_eps, "qk_eps": lay.qk_eps, "n_heads": self.n_heads, "n_kv": self.n_kv,
                "head_dim": self.head_dim, "kind": lay.kind, **lay.pre_options}

    def kv_bytes(self) -> int:
        return 2 * sum(c.numel() * c.element_size() for c in self.k_caches.values())

    def _logits(self, h: Tensor) -> Tensor:
        return final_logits(h, self.norm_w, self.lm_head_w, self.lm_head_b, **self.logits_kw)

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

    def _visible(self, query_positions: Tensor, key_count: int, window: int | None) -> Tensor:
        """[..., key_count] bool: keys 0..key_count-1 a query at each position sees (causal, in its window)."""
        return self._rule(window, self.max_len, 1)(query_positions[..., None], 0, self.key_positions[:key_count])

    def _sinks(self, lay: LayerWeights, shape: tuple[int, ...]) -> Tensor | None:
        return None if lay.sinks is None else lay.sinks.view(shape)

    def _prefill(
        self, ids: Tensor, lengths: Tensor, slot_ids: Tensor, tap_layers: Sequence[int]
    ) -> tuple[Tensor, Tensor | None]:
        b, t = ids.shape
        x = self._embed(ids)
        rep = self.n_heads // self.n_kv
        taps: dict[int, Tensor] = {}
        for i, lay in enumerate(self.layers):
            cos, sin = (table[:t, None, :] for table in self.ropes[lay.rope])  # [T, 1, D] over [B, T, heads, D]
            q, k, v = pre_attention(x, cos, sin, *lay.pre, **self._pre_kw(lay))
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, kv, T, D]
            self._write_prompts(i, k, v, lengths, slot_ids)
            if rep > 1:  # same as transformers' repeat_kv
                k = k[:, :, None].expand(b, self.n_kv, rep, t, self.head_dim).reshape(b, self.n_heads, t, self.head_dim)
                v = v[:, :, None].expand(b, self.n_kv, rep, t, self.head_dim).reshape(b, self.n_heads, t, self.head_dim)
            mask = self._visible(self.key_positions[:t], t, lay.window) if lay.window else None  # None: causal
            o = masked_attention(q.transpose(1, 2), k, v, mask, scale=self.scale, score_cap=self.score_cap,
                                 sinks=self._sinks(lay, (1, self.n_heads, 1, 1)))
            x = post_attention(x, o.transpose(1, 2).reshape(b, t, -1), *lay.post, **lay.post_kw)
            if i in tap_layers:
                taps[i] = x
        last = x[torch.arange(b, device=x.device), lengths - 1]
        return self._logits(last), self._concat_taps(taps, tap_layers)

    def _write_prompts(self, i: int, k: Tensor, v: Tensor, lengths: Tensor, slot_ids: Tensor) -> None:
        """k/v [B, kv, T, D] of right-padded prompts into layer i's cache rows `slot_ids`: every
        position, or into a ring only each prompt's last W (its window: all a later query sees;
        a short prompt's padding lands on positions past it, which read as too old until written)."""
        t, length = k.shape[2], self.cache_lens[i]
        if length == self.max_len:
            self.k_layers[i][slot_ids, :, :t] = k
            self.v_layers[i][slot_ids, :, :t] = v
            return
        keep = min(t, self.layers[i].window)
        first = (lengths.to(self.device) - keep).clamp(min=0)  # [B]: each prompt's first position kept
        grid = first[:, None] + self.key_positions[None, :keep]  # [B, keep], all < T
        pick = grid[:, None, :, None].expand(-1, self.n_kv, -1, self.head_dim)
        rows, ring_slots = slot_ids.to(self.device)[:, None], torch.remainder(grid, length)
        self.k_layers[i][rows, :, ring_slots] = k.gather(2, pick).transpose(1, 2)  # [B, keep, kv, D]
        self.v_layers[i][rows, :, ring_slots] = v.gather(2, pick).transpose(1, 2)

    def _decode_visible(self, positions: Tensor, kv_len: int, window: int | None, length: int) -> Tensor:
        """[S, 1, 1, n] bool: the cache slots 0..n-1 (n = min(kv_len, length)) a decode query at each
        slot's position sees; a ring's slot j read as the latest position at or before it."""
        keys = self.key_positions[None, :min(kv_len, length)]
        return self._rule(window, length, 1)(positions[:, None], 0, keys)[:, None, None, :]

    @staticmethod
    def _concat_taps(taps: dict[int, Tensor], tap_layers: Sequence[int], out: Tensor | None = None) -> Tensor | None:
        if not tap_layers:
            return None
        return torch.cat([taps[i] for i in tap_layers], dim=-1, out=out)

    def decode(self, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """One token for every slot: tokens/positions [slots] -> logits [slots, V].

        Fixed shapes for a given `kv_len` and no host synchronisation: safe to capture in a
        CUDA graph. Attention reads cache positions [0, kv_len) of each slot, masked to
        positions <= the slot's own (and within a sliding-window layer's window); the caller
        guarantees max(positions) < kv_len. With `attention_kind` flex it is `verify` of one
        token per slot, which reads every slot's cache only up to its own position (by 128-key
        blocks) whatever `kv_len`."""
        if self.attention_kind == "flex":  # each slot reads only its own 128-key blocks
            return self.verify(tokens[:, None], positions, kv_len)[0][:, 0]
        s, rep = self.slots, self.n_heads // self.n_kv
        x = self._embed(tokens)  # [S, H]
        ropes = {name: (cos[positions][:, None, :], sin[positions][:, None, :])  # [S, 1, D]
                 for name, (cos, sin) in self.ropes.items()}
        visible = {(w, n): self._decode_visible(positions, kv_len, w, n) for w, n in self.kinds}
        slots = {n: self._slots_of(positions, n) for n in set(self.cache_lens)}  # each slot's cache slot
        for i, lay in enumerate(self.layers):
            q, k, v = self.pre_attention(x, *ropes[lay.rope], *lay.pre, **self._pre_kw(lay))
            kc, vc, length = self.k_layers[i], self.v_layers[i], self.cache_lens[i]
            kc[self.rows, :, slots[length]] = k
            vc[self.rows, :, slots[length]] = v
            n = min(kv_len, length)
            # GQA without repeating the cache: the `rep` query heads sharing a kv head become
            # that head's `rep` query rows (all at the same position, so one mask serves all).
            o = masked_attention(q.view(s, self.n_kv, rep, self.head_dim), kc[:, :, :n], vc[:, :, :n],
                                 visible[(lay.window, length)], scale=self.scale, score_cap=self.score_cap,
                                 sinks=self._sinks(lay, (1, self.n_kv, rep, 1)))
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
        if t > self.width and min(self.cache_lens) < self.max_len:
            raise ValueError(f"verify of {t} tokens a slot: this decoder's rings hold blocks of up to {self.width} "
                             f"(StaticDecoder(width=...))")
        grid = positions[:, None] + self.key_positions[None, :t]  # [S, T] each token's position
        x = self._embed(tokens)  # [S, T, H]
        ropes = {name: (cos[grid][:, :, None, :], sin[grid][:, :, None, :])  # [S, T, 1, D]
                 for name, (cos, sin) in self.ropes.items()}
        attentions = {(w, n): self._attention(s, t, w, n) for w, n in self.kinds}
        for (_, n), attention in attentions.items():
            attention.prepare(positions, min(kv_len, n))  # once for all layers of its kind
        # (s, t, j) -> row s, head j, the cache slot of grid[s, t]; one index per cache length
        index = {n: cache_index(self.rows[:s], self._slots_of(grid, n), self.n_kv, n) for n in set(self.cache_lens)}
        taps: dict[int, Tensor] = {}
        for i, lay in enumerate(self.layers):
            length = self.cache_lens[i]
            q = self.q_writing_kv(x, *ropes[lay.rope], *lay.pre, k_flat=self.k_flat[i], v_flat=self.v_flat[i],
                                  index=index[length], **self._pre_kw(lay))  # q [S, T, h, D]; k/v into the cache
            attn = attentions[(lay.window, length)].attend(q, self.k_layers[i], self.v_layers[i], lay.sinks)
            x = self.post_attention(x, attn, *lay.post, **lay.post_kw)
            if i in tap_layers:
                taps[i] = x
        return self.final_logits(x, self.norm_w, self.lm_head_w, self.lm_head_b, **self.logits_kw), \
            self._concat_taps(taps, tap_layers, taps_out)
