"""The DFlash drafter's proposal forward on static per-slot caches, for the speculative engine.

It reads the weights of a `DFlashDrafter` (nothing is copied) and repeats its op sequence
(drafter/model.py), with the context K/V of every layer kept in a static cache:

    k_cache, v_cache: [layers, slots, kv_heads, cache_len, head_dim]   (cache_len: max_len, or a ring's)

Position p of a slot holds the context K/V of the token committed at p (its projected target
taps). A round of the engine, for a slot whose last committed token t sits at position p:

    extend(taps, start)   the taps of the block the target verified last round, at positions
                          start..start+B-1: context K/V written there. Only the committed part
                          (positions < p) is ever read; the rest is garbage, overwritten below.
    propose(tokens, p)    the block [t, MASK x (B-1)] at positions p..p+B-1. Its own K/V go into
                          the same cache rows at p..p+B-1 (exactly the positions no committed
                          context occupies yet), so one attention over cache positions
                          [0, kv_len) covers context and block keys; the mask picks them by
                          position with the training rule (drafter/masks.py):
                            context key l: l < p, and (p + k) - l < W on a sliding-window layer
                            block key l = p + k': k' <= k on a layer causal within the block
                          drafts = argmax of the target's LM head over slots 1..B-1.

Bounded context (a ring). When every layer attends through a sliding window (the drafter's
own `sliding_window`, or `window`: a decode-time window for its full-attention layers), no
query ever sees a context key more than W-1 positions back. The cache then holds only a ring
of `ring_len` = W + 2B positions (rounded up to whole blocks for FlexAttention) per slot: position
x lives at ring slot x mod ring_len, and the mask reads ring slot j as the latest position
x = p + B - 1 - ((p + B - 1 - j) mod ring_len) at or before the block's last one (keys with
x < 0 were never written: hidden). Every write is at a position <= p + B - 1, so a ring slot
holds exactly that x whenever the rule can see it; the writes of one call (B positions, or the
prompt's last W) never collide. A proposal then reads at most ring_len keys per layer, and the
prompt's context projection covers only its last W taps, whatever the context's length: the
drafts are those of the full cache (the rule hides the same keys), up to the order of float
sums in the softmax. With a full-attention layer (and no `window`) the cache keeps every
position, and drafting cost grows with the context.

Fixed shapes for a given `kv_len`, no host synchronisation: both calls can be captured in one
CUDA graph. One exception to "nothing is copied": the context K/V of all layers come from one
matmul over the layers' k_proj/v_proj weights concatenated at construction (a round then
launches 2 matmuls for them instead of 2 per layer), so build the StaticDrafter after the
drafter's weights are final (as an evaluation does).
"""

from __future__ import annotations

import copy
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_train.drafter import dspark
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.generate.attention import (AttentionKind, CacheAttention, cache_index, flat, ring_length,
                                             ring_rule, write_cache)
from dflash_train.speculative.loop import layer_windows
from dflash_train.target.ops import apply_rope, rms_norm


class DraftSource(Protocol):
    """What proposes drafts inside the engine (speculative/engine.py): `StaticDrafter` or a
    test double."""

    block_size: int
    target_layer_ids: list[int]

    def start(self, ids: Tensor, lengths: Tensor, slot_ids: Tensor, taps: Tensor) -> None:
        """Prompts ids [n, T] (right padded, `lengths` [n]) were prefilled into `slot_ids`, with
        taps [n, T, n*H]."""

    def extend(self, taps: Tensor, start: Tensor) -> None:
        """Taps [S, B, n*H] of the block verified last, at positions start[s] + 0..B-1."""

    def propose(self, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """Drafts [S, B-1] after each slot's last committed token tokens[s] at positions[s]."""


def block_rule(block_size: int, window: int | None, causal: bool):
    """The training mask (drafter/masks.py) of a block at positions p..p+B-1 over the cache:
    context keys before p (within `window` of the query on a sliding-window layer) and the
    block's own keys (only those up to the query's on a layer causal within the block)."""

    def visible(p: Tensor, q: Tensor, key: Tensor) -> Tensor:
        context = key < p
        if window is not None:
            context = context & (p + q - key < window)
        in_block = (key >= p) & (key < p + block_size)
        if causal:
            in_block = in_block & (key - p <= q)
        return context | in_block

    return visible


def drafter_like(drafter: DFlashDrafter, like: Tensor) -> DFlashDrafter:
    """`drafter` on the device and in the dtype of `like`: itself if it already is, else a
    converted copy, so the caller's module (say, a drafter in training with fp32 master
    weights) is never changed."""
    w = drafter.fc.weight
    if w.device == like.device and w.dtype == like.dtype:
        return drafter
    return copy.deepcopy(drafter).to(device=like.device, dtype=like.dtype)


def _norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The drafter's RMSNorm (scale in float32, then cast: drafter/model.py `RMSNorm`)."""
    return rms_norm(x, weight, eps, scale_in_float32=True)


class _DrafterLayer:
    """One drafter layer's weights grouped as the arguments of `_block_qkv` and
    `_post_attention` (plain tensors: a compiled version serves all layers). q/k/v and
    gate/up are concatenated (one matmul each instead of three and two: the proposal of a
    small drafter is bound by kernel launches, not FLOPs); `refresh` copies them anew."""

    def __init__(self, layer) -> None:
        self.layer = layer
        attn = layer.self_attn
        w_qkv, w_gate_up = self._fused()
        self.qkv = (layer.input_layernorm.weight, w_qkv, attn.q_norm.weight, attn.k_norm.weight)
        self.post = (attn.o_proj.weight, layer.post_attention_layernorm.weight, w_gate_up, layer.mlp.down_proj.weight)
        self.eps = float(layer.input_layernorm.eps)
        self.qk_eps = float(attn.q_norm.eps)
        self.post_eps = float(layer.post_attention_layernorm.eps)

    @torch.no_grad()
    def _fused(self) -> tuple[Tensor, Tensor]:
        attn, mlp = self.layer.self_attn, self.layer.mlp
        return (torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))

    def refresh(self) -> None:
        """Copy the layer's current weights into the fused ones (in place: graphs keep them)."""
        for dst, src in zip((self.qkv[1], self.post[2]), self._fused()):
            dst.copy_(src)


def _block_q(
    x: Tensor, cos: Tensor, sin: Tensor, ln_w: Tensor, w_qkv: Tensor, qn_w: Tensor, kn_w: Tensor,
    *, k_flat: Tensor, v_flat: Tensor, index: Tensor, eps: float, qk_eps: float, n_heads: int, n_kv: int,
    head_dim: int,
) -> Tensor:  # fmt: skip
    """Residual x [S, B, H] -> q [S, B, h, d] of the block (normed, rotated); its k/v [S, B, g, d]
    go into the cache (flat views, at `index`: generate/attention.py)."""
    h = _norm(x, ln_w, eps)
    lead = h.shape[:-1]
    q, k, v = F.linear(h, w_qkv).split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    q = _norm(q.reshape(*lead, n_heads, head_dim), qn_w, qk_eps)
    k = _norm(k.reshape(*lead, n_kv, head_dim), kn_w, qk_eps)
    write_cache(k_flat, index, apply_rope(k, cos, sin))
    write_cache(v_flat, index, v.reshape(*lead, n_kv, head_dim))
    return apply_rope(q, cos, sin)


def _context_kv(
    taps: Tensor, cos: Tensor, sin: Tensor, fc_w: Tensor, hn_w: Tensor, w_kv: Tensor, kn_w: Tensor, *,
    k_flat: Tensor, v_flat: Tensor, index: Tensor, hn_eps: float, qk_eps: float, n_layers: int, n_kv: int,
    head_dim: int,
) -> None:  # fmt: skip
    """Taps [S, T, n*H] -> context k/v [S, T, layers, g, d] of every layer, written into the
    cache of all layers (flat views, at `index`): projected by fc and normed
    (drafter/model.py), then each layer's k/v (the context never passes through q).
    w_kv [layers*2*g*d, H]: each layer's k_proj then v_proj rows; kn_w [layers, 1, d]: the
    k_norm weights; cos/sin [S, T, 1, 1, d]."""
    ctx = _norm(F.linear(taps.to(fc_w.dtype), fc_w), hn_w, hn_eps)  # [S, T, H]
    kv = F.linear(ctx, w_kv).view(*ctx.shape[:-1], n_layers, 2, n_kv, head_dim)
    write_cache(k_flat, index, apply_rope(_norm(kv[..., 0, :, :], kn_w, qk_eps), cos, sin))
    write_cache(v_flat, index, kv[..., 1, :, :])


def _post_attention(x: Tensor, attn_out: Tensor, wo: Tensor, ln2_w: Tensor, w_gate_up: Tensor, wd: Tensor, *,
                    eps: float) -> Tensor:
    x = x + F.linear(attn_out, wo)
    gate, up = F.linear(_norm(x, ln2_w, eps), w_gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, wd)


def _draft_head(x: Tensor, norm_w: Tensor, lm_head_w: Tensor, *, eps: float) -> Tensor:
    """Residual of the block [S, B, H] -> drafts [S, B-1]: the greedy tokens of slots 1..B-1."""
    hidden = _norm(x[:, 1:], norm_w, eps)
    return F.linear(hidden.to(lm_head_w.dtype), lm_head_w).argmax(-1)


class StaticDrafter:
    """DFlash proposals for `slots` sequences of at most `max_len` positions (see module doc).

    `drafter` must already be on the target's device, in the dtype it should run in. `window`:
    decode its full-attention layers with this sliding window (drafts change; a speculative
    output never does), so that the context is bounded by a ring (module doc)."""

    def __init__(self, drafter: DFlashDrafter, embed_w: Tensor, lm_head_w: Tensor, slots: int, max_len: int,
                 attention: AttentionKind = "dense", window: int | None = None) -> None:
        cfg = drafter.config
        if window is not None and window < 1:
            raise ValueError(f"the drafting window must be >= 1, got {window}")
        self.config = cfg
        self.module = drafter
        self.block_size = cfg.block_size
        self.target_layer_ids = list(cfg.target_layer_ids)
        self.embed_w, self.lm_head_w = embed_w, lm_head_w
        self.fc_w = drafter.fc.weight
        self.hidden_norm_w, self.hidden_norm_eps = drafter.hidden_norm.weight, float(drafter.hidden_norm.eps)
        self.norm_w, self.norm_eps = drafter.norm.weight, float(drafter.norm.eps)
        self.layers = [_DrafterLayer(layer) for layer in drafter.layers]
        attns = [layer.self_attn for layer in drafter.layers]
        self.context_w = torch.cat([torch.cat([a.k_proj.weight, a.v_proj.weight]) for a in attns]).detach()
        self.context_kn_w = torch.stack([a.k_norm.weight for a in attns])[:, None, :].detach()  # [layers, 1, d]
        if len({a.k_norm.eps for a in attns}) != 1:
            raise ValueError("the drafter's layers use different k_norm eps")
        self.context_eps = float(attns[0].k_norm.eps)
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.slots, self.max_len = slots, max_len
        self.dtype, self.device = self.fc_w.dtype, self.fc_w.device
        self.mask_token_id = cfg.mask_token_id
        self.windows = layer_windows(cfg, window)
        self.ring_len = ring_length(self.windows, self.block_size, max_len, attention)  # None: all kept
        self.cache_len = self.ring_len or max_len

        shape = (len(self.layers), slots, self.n_kv, self.cache_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_flat, self.v_flat = flat(self.k_cache), flat(self.v_cache)  # all layers (context writes)
        self.layer_k_flat = [flat(c) for c in self.k_cache]  # per layer (block writes)
        self.layer_v_flat = [flat(c) for c in self.v_cache]
        positions = torch.arange(max_len, device=self.device)
        with torch.no_grad():  # the drafter's own rotary module: the same values as in training
            cos, sin = drafter.rotary(positions[None], self.dtype)  # [1, 1, max_len, d]
        self.cos, self.sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()  # [max_len, d]
        self.key_positions = positions
        self.rows = torch.arange(slots, device=self.device)
        self.variants = [(w, cfg.causal_in_block_of(i)) for i, w in enumerate(self.windows)]
        # The per-layer pieces; an engine may swap in torch.compile'd versions.
        self.block_q: Callable[..., Tensor] = _block_q
        self.context_kv: Callable[..., None] = _context_kv
        self.post_attention: Callable[..., Tensor] = _post_attention
        self.head: Callable[..., Tensor] = _draft_head
        self.dspark_head: Callable[..., Tensor] = dspark.draft_head  # a dspark drafter's head
        self.attention_kind = attention  # generate/attention.py
        self._attentions: dict[tuple[int | None, bool], CacheAttention] = {}

    @torch.no_grad()
    def refresh(self, source: DFlashDrafter) -> None:
        """Take the current weights of `source` (the same drafter, e.g. in training): copied into
        the module read here (nothing to copy when it is `source` itself) and the concatenated
        weights rebuilt in place, so captured CUDA graphs replay with the new weights."""
        if source is not self.module:
            for (name, dst), (_, src) in zip(self.module.named_parameters(), source.named_parameters(), strict=True):
                dst.copy_(src)
        for layer in self.layers:
            layer.refresh()
        attns = [layer.self_attn for layer in self.module.layers]
        self.context_w.copy_(torch.cat([torch.cat([a.k_proj.weight, a.v_proj.weight]) for a in attns]))
        self.context_kn_w.copy_(torch.stack([a.k_norm.weight for a in attns])[:, None, :])

    def kv_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def _slots_of(self, grid: Tensor) -> Tensor:
        """Cache positions of the sequence positions `grid`: themselves, or their ring slots."""
        return grid if self.ring_len is None else torch.remainder(grid, self.ring_len)

    def _write_context(self, taps: Tensor, start: Tensor, rows: Tensor, context_kv: Callable[..., tuple]) -> None:
        """Context K/V of taps [R, T, n*H] at positions start[r] + 0..T-1 of cache rows `rows` [R]."""
        t = taps.shape[1]
        grid = start[:, None] + self.key_positions[None, :t]  # [R, T]
        cos, sin = self.cos[grid][:, :, None, None, :], self.sin[grid][:, :, None, None, :]  # [R, T, 1, 1, d]
        index = cache_index(rows, self._slots_of(grid), self.n_kv, self.cache_len, len(self.layers), self.slots)
        context_kv(taps, cos, sin, self.fc_w, self.hidden_norm_w, self.context_w, self.context_kn_w,
                   k_flat=self.k_flat, v_flat=self.v_flat, index=index, hn_eps=self.hidden_norm_eps,
                   qk_eps=self.context_eps, n_layers=len(self.layers), n_kv=self.n_kv, head_dim=self.head_dim)

    def start(self, ids: Tensor, lengths: Tensor, slot_ids: Tensor, taps: Tensor) -> None:
        """After a prefill: the prompts' taps [n, T, n*H] (right padded) become the context of
        cache rows `slot_ids` [n] at positions 0..T-1 (padding rows: garbage past the length,
        never read). With a ring, only each prompt's last W positions (W the widest window: all
        any query can see) are projected and written. `ids` is unused here (test doubles read
        it). Eager and uncompiled: prompt widths vary, and a compiled function would recompile
        for each."""
        keep = taps.shape[1] if self.ring_len is None else min(taps.shape[1], max(self.windows))
        if keep == taps.shape[1]:
            self._write_context(taps, torch.zeros_like(slot_ids), slot_ids, _context_kv)
            return
        first = (lengths.to(self.device) - keep).clamp(min=0)  # [n]: a prompt's first position kept
        grid = first[:, None] + self.key_positions[None, :keep]  # [n, keep], all < T
        kept = taps.gather(1, grid[:, :, None].expand(-1, -1, taps.shape[-1]))
        self._write_context(kept, first, slot_ids, _context_kv)

    def extend(self, taps: Tensor, start: Tensor) -> None:
        """Taps [S, B, n*H] of the block verified last, at positions start[s] + 0..B-1 of every slot."""
        self._write_context(taps, start, self.rows, self.context_kv)

    def _attention(self, window: int | None, causal: bool) -> CacheAttention:
        """The cache attention of one (window, causal_in_block) layer variant (made on first use:
        a warm-up, never inside a CUDA-graph capture)."""
        if (window, causal) not in self._attentions:
            rule = block_rule(self.block_size, window, causal)
            if self.ring_len is not None:
                rule = ring_rule(rule, self.ring_len, self.block_size)
            self._attentions[window, causal] = CacheAttention(
                rule, self.attention_kind, slots=self.slots,
                q_len=self.block_size, max_len=self.cache_len, n_heads=self.n_heads, n_kv=self.n_kv,
                head_dim=self.head_dim, scale=None, dtype=self.dtype, device=self.device)
        return self._attentions[window, causal]

    def block_hidden(self, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """Final normed hidden states [S, B, H] of the blocks [tokens[s], MASK, ...] at positions[s]."""
        return _norm(self._block_residual(tokens, positions, kv_len), self.norm_w, self.norm_eps)

    def _block_residual(self, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """The residual stream [S, B, H] after the last layer (before the final norm)."""
        s, b = tokens.shape[0], self.block_size
        ids = torch.cat([tokens[:, None], torch.full_like(tokens, self.mask_token_id)[:, None].expand(s, b - 1)], 1)
        x = F.embedding(ids, self.embed_w).to(self.dtype)  # [S, B, H]
        grid = positions[:, None] + self.key_positions[None, :b]  # [S, B]
        cos, sin = self.cos[grid][:, :, None, :], self.sin[grid][:, :, None, :]  # [S, B, 1, d]
        attentions = [self._attention(*variant) for variant in self.variants]
        for att in dict.fromkeys(attentions):  # once per distinct variant, for all its layers
            att.prepare(positions, min(kv_len, self.cache_len))  # a ring: at most its length
        index = cache_index(self.rows[:s], self._slots_of(grid), self.n_kv, self.cache_len)
        for i, lay in enumerate(self.layers):
            q = self.block_q(x, cos, sin, *lay.qkv, k_flat=self.layer_k_flat[i], v_flat=self.layer_v_flat[i],
                             index=index, eps=lay.eps, qk_eps=lay.qk_eps, n_heads=self.n_heads, n_kv=self.n_kv,
                             head_dim=self.head_dim)
            x = self.post_attention(x, attentions[i].attend(q, self.k_cache[i], self.v_cache[i]), *lay.post,
                                    eps=lay.post_eps)
        return x

    def propose(self, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """Drafts [S, B-1] following tokens [S] (each slot's last committed token, at positions [S]).
        The caller guarantees max(positions) + B <= kv_len <= max_len."""
        x = self._block_residual(tokens, positions, kv_len)
        markov = self.module.markov_head
        if markov is not None:  # the bigram head: slots drafted left to right (drafter/dspark.py)
            return self.dspark_head(x, self.norm_w, self.lm_head_w, tokens, *markov.weights(), eps=self.norm_eps)
        return self.head(x, self.norm_w, self.lm_head_w, eps=self.norm_eps)
