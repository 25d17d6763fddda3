"""Attention of a block of queries per slot over a static KV cache: one rule, two kernels.

The engines' steps (StaticDecoder.verify, StaticDrafter.propose) attend T queries per slot
(a block at positions p..p+T-1; T = 1 for plain decoding) to that slot's cache

    k_cache, v_cache: [slots, kv_heads, max_len, head_dim]

Which keys a query sees is one rule, `visible(p, q, key)` of the block's first position p,
the query's index q in the block and the key's position (broadcasting tensors -> bool).

GQA without repeating the cache: the `rep` query heads of a kv head can become rep*T query
rows of that head (row r*T + t is query head j*rep + r at block index t), q and the output
permuted around the kernel (views when T = 1, two copies per layer when T > 1). Two kernels
apply the rule:

    dense   SDPA over cache positions [0, kv_len) with an additive mask built from the rule
            once per step (shared by all layers), GQA always folded. CPU (no fused
            FlexAttention kernel there), and CUDA without torch.compile.
    flex    compiled FlexAttention over the whole cache, the rule as its mask_mod, and per
            slot the number of 128-key blocks up to the block's last position, computed on
            device from the positions: the kernel reads only the blocks a slot has reached.
            Only CUDA (a fused kernel needs torch.compile; its CPU build costs seconds per shape).
            GQA folded only at many slots (`folds_gqa`): there the fold lets the compiler take
            its decoding kernel, which it does only for a power-of-two group of query heads per
            kv head (SmolLM2: 9 over 3 is not one; folded, the group is 1) and which then reads
            each kv head once per slot, where the main kernel reads it once per query head. At
            a few slots q keeps its layout (native GQA, no copies), as batch-1 speculative
            rounds were tuned.

Both are fixed-shape and free of host synchronisation, so a step using them can be captured
in a CUDA graph. The rule must make a query see at least one key (its own position).

Writes go through `cache_index` / `write_cache` into flat views of the caches ([-1, D], made
once): one flat index per step, then one scatter per cache and layer, whatever the strides
of the values. Inside a torch.compile'd function that scatter fuses into the kernel that
computes the values, and happens in place because the flat view is the function's input
(a view taken inside it would make inductor copy the whole cache around the scatter).
"""

from __future__ import annotations

from typing import Callable, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from dflash_train.target.ops import soft_cap
from dflash_train.target.packed_gemma import soft_capped
from dflash_train.utils.compile import compiled_once
from dflash_train.utils.flex_masks import (FLEX_MAX_HEAD_DIM, FLEX_MIN_HEAD_DIM, LSE_REQUEST, TILE, BlockMask,
                                           output_and_lse)

Rule = Callable[[Tensor, Tensor, Tensor], Tensor]  # (p, q, key) -> visible, broadcasting
AttentionKind = Literal["dense", "flex"]
FLEX_BLOCK = TILE  # keys per FlexAttention block; `max_len` must be a multiple of it

# Each mask rule (causal, windowed, ring), query shape (decode, every prefill chunk shape) and
# output kind (with the log-sum-exp for sinks) is one more compiled entry of flex_attention's
# code, shared with the drafter's: a windowed target past Dynamo's default of 8 entries failed
# mid-run ("recompile limit exceeded": gpt-oss, sliding and full layers, a few prefill shapes)
FLEX_RECOMPILE_LIMIT = 64


def _flex_kernel() -> Callable[..., Tensor]:
    """One compiled FlexAttention for the process (each distinct shape compiles once)."""
    return compiled_once(flex_attention, entries=FLEX_RECOMPILE_LIMIT)


def folds_gqa(kind: AttentionKind, slots: int, n_kv: int, device: torch.device) -> bool:
    """Whether q reaches the kernel with GQA folded into query rows. Always for dense. For flex
    when slots x kv heads exceed the device's SMs: there the compiler's decoding kernel covers
    the GPU without splitting a slot's keys across thread blocks. With fewer, it would split
    them and reduce the splits in extra kernels, a cost in launch-bound batch-1 steps (a few
    hundred kernels of a few us each, over keys that fill a few 128-key blocks), so q keeps
    its layout there and the main kernel runs, one per layer. (On a CPU, every slot count.)"""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
    return kind == "dense" or slots * n_kv > sms


def causal_rule(p: Tensor, q: Tensor, key: Tensor) -> Tensor:
    """The target's: a query at position p + q sees every key at or before it."""
    return key <= p + q


def windowed_rule(window: int) -> Rule:
    """A sliding-window layer's: a query at position p + q sees the `window` keys ending at it
    (transformers' sliding-window mask: q - window < key <= q)."""

    def rule(p: Tensor, q: Tensor, key: Tensor) -> Tensor:
        return (key <= p + q) & (key > p + q - window)

    return rule


def ring_rule(rule: Rule, ring_len: int, block_size: int) -> Rule:
    """`rule` over a ring cache of `ring_len` positions a slot, for blocks of `block_size` queries:
    position x lives at ring slot x mod ring_len, and ring slot j is read as the latest position at
    or before the block's last one that is j modulo `ring_len`; a slot never written (negative) is
    hidden. Sized by `ring_length`, every key a query may see is still in the ring, and an entry
    left by a rejected draft reads as a position too old for any window."""

    def visible(p: Tensor, q: Tensor, slot: Tensor) -> Tensor:
        last = p + (block_size - 1)
        key = last - torch.remainder(last - slot, ring_len)
        return (key >= 0) & rule(p, q, key)

    return visible


def ring_length(windows: list[int | None], block_size: int, max_len: int, attention: AttentionKind) -> int | None:
    """Cache positions per slot that layers with these windows need for blocks of up to
    `block_size` queries: W + 2B (the widest window W), in whole blocks for FlexAttention; None
    when they need them all (a full-attention layer) or the ring would be no shorter than `max_len`."""
    if not windows or any(w is None for w in windows):
        return None
    ring = max(windows) + 2 * block_size  # type: ignore[type-var]
    if attention == "flex":
        ring = -(-ring // FLEX_BLOCK) * FLEX_BLOCK
    return ring if ring < max_len else None


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, scale: float | None,
                     score_cap: float | None = None, sinks: Tensor | None = None) -> Tensor:
    """softmax(q k^T * scale + mask) v over the last two axes; q [..., Tq, D], k/v [..., Tk, D];
    `mask` boolean (True: visible) or additive, broadcasting to [..., Tq, Tk], None for causal
    over Tq = Tk. Gemma 2's `score_cap` caps the scaled scores (cap * tanh(s / cap)) before the
    mask; gpt-oss's `sinks` (broadcasting to [..., Tq, 1]) are one more logit per head that takes
    probability and adds no value. Without either it is SDPA; with them an explicit softmax in
    float32, as transformers' eager attention for those models."""
    if score_cap is None and sinks is None:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    scores = soft_cap(scores, score_cap)
    if mask is None:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs[..., :k.shape[-2]].to(v.dtype), v)


def blocks_needed(last_position: Tensor, max_len: int) -> Tensor:
    """FlexAttention blocks that cover keys 0..last_position (per slot), int32."""
    return (last_position // FLEX_BLOCK + 1).clamp(max=max_len // FLEX_BLOCK).to(torch.int32)


def cache_index(rows: Tensor, grid: Tensor, n_kv: int, max_len: int, n_layers: int | None = None,
                slots: int = 0) -> Tensor:
    """Flat row indices into a cache viewed as [-1, head_dim], for values [R, T, (layers,) kv, D]:
    element (r, t, (l,) j) -> cache (layer l,) row rows[r], kv head j, position grid[r, t].
    rows [R], grid [R, T]; with `n_layers` the cache is [layers, slots, kv, max_len, D] (all
    layers at once), without it one layer's [slots, kv, max_len, D]."""
    base = rows[:, None] * n_kv * max_len + grid  # [R, T]
    heads = torch.arange(n_kv, device=rows.device) * max_len  # [kv]
    if n_layers is None:
        return base[:, :, None] + heads
    layers = torch.arange(n_layers, device=rows.device) * slots * n_kv * max_len  # [layers]
    return base[:, :, None, None] + layers[:, None] + heads


def flat(cache: Tensor) -> Tensor:
    """The [-1, head_dim] view `write_cache` writes through."""
    return cache.view(-1, cache.shape[-1])


def write_cache(cache_flat: Tensor, index: Tensor, values: Tensor) -> None:
    """cache_flat[index] = values (index.shape + [D]): one scatter."""
    cache_flat.index_put_((index,), values)


def decode_attention_for(device: torch.device, compile: bool, head_dims: Sequence[int | None] = ()) -> AttentionKind:
    """The engines' decode attention when asked for `auto`: flex on a GPU, where each slot reads
    only its own cache blocks while dense reads every slot up to the longest row's bucket
    (SmolLM2 on an H200, the recipe's real prompts: 7.0 vs 8.9 ms per step at 256 slots; 28.7K
    new tok/s at 768 slots against dense's 18.7K at 256). Its fused kernel needs torch.compile
    (the CPU runs the unfused reference, slower than dense) and heads of at least
    FLEX_MIN_HEAD_DIM dims and at most FLEX_MAX_HEAD_DIM: others (`head_dims`: the target's and the
    drafter's; None is unknown) take dense from the start rather than after a failed compile."""
    heads_fit = all(d is None or FLEX_MIN_HEAD_DIM <= d <= FLEX_MAX_HEAD_DIM for d in head_dims)
    return "flex" if compile and heads_fit and torch.device(device).type == "cuda" else "dense"


def use_dense_attention(*parts) -> None:
    """Switch steps (StaticDecoder, StaticDrafter: an `attention_kind` and their CacheAttentions
    by shape) to the dense kernel, e.g. when FlexAttention cannot compile; the masks are made
    again on the next call."""
    for part in parts:
        part.attention_kind = "dense"
        part._attentions.clear()


class CacheAttention:
    """`rule`-masked attention of `q_len` queries per slot over `slots` static cache rows.

    Per step: `prepare(positions, kv_len)` once (positions [S]: each slot's block start), then
    `attend(q, k_cache, v_cache)` per layer: q [S, T, heads, D] -> [S, T, heads * D]. `score_cap`
    (Gemma 2) caps the scaled scores; `attend`'s `sinks` (gpt-oss) add one logit per head
    (masked_attention says how). A `window` (the rule's sliding window, in keys) lets flex skip the
    blocks that lie wholly before it."""

    def __init__(self, rule: Rule, kind: AttentionKind, *, slots: int, q_len: int, max_len: int, n_heads: int,
                 n_kv: int, head_dim: int, scale: float | None, dtype: torch.dtype, device: torch.device,
                 score_cap: float | None = None, window: int | None = None) -> None:
        if kind not in ("dense", "flex"):
            raise ValueError(f"attention kind must be 'dense' or 'flex', not {kind!r}")
        if kind == "flex" and max_len % FLEX_BLOCK:
            raise ValueError(f"flex attention needs max_len to be a multiple of {FLEX_BLOCK}, got {max_len}")
        self.rule, self.kind = rule, kind
        self.slots, self.q_len, self.max_len = slots, q_len, max_len
        self.n_heads, self.n_kv, self.head_dim, self.scale = n_heads, n_kv, head_dim, scale
        self.score_cap, self.window = score_cap, window
        self.score_mod = soft_capped(score_cap) if score_cap else None  # flex's form of the cap
        self.rep = n_heads // n_kv  # query heads per kv head
        self.folded = folds_gqa(kind, slots, n_kv, torch.device(device))  # q as [S, kv, rep*T, D]
        self.dtype, self.device = dtype, device
        self.key_positions = torch.arange(max_len, device=device)
        self.kv_len = max_len
        self.bias: Tensor | None = None
        if kind == "flex":
            # Static buffers the compiled kernel reads on every replay: the block starts (for
            # the mask_mod) and the per-slot block counts; prepare() overwrites them in place.
            self.start = torch.zeros(slots, dtype=torch.long, device=device)
            self.num_blocks = torch.ones(slots, 1, 1, dtype=torch.int32, device=device)
            n = max_len // FLEX_BLOCK
            self.block_ids = torch.arange(n, dtype=torch.int32, device=device)
            self.indices = indices = self.block_ids.expand(slots, 1, 1, n).contiguous()  # per slot: from its first block
            start = self.start

            def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return rule(start[b], q_idx % q_len, kv_idx)  # folded row r*T + t is block index t

            rows = self.rep * q_len if self.folded else q_len
            self.block_mask = BlockMask.from_kv_blocks(self.num_blocks, indices, BLOCK_SIZE=FLEX_BLOCK,
                                                       mask_mod=mask_mod, seq_lengths=(rows, max_len))
            self._kernel = _flex_kernel() if device.type == "cuda" else flex_attention

    def visible(self, positions: Tensor, kv_len: int) -> Tensor:
        """The rule as a dense mask [S, T, kv_len] (what `dense` applies; tests compare with it)."""
        p = positions[:, None, None]
        q = self.key_positions[None, : self.q_len, None]
        key = self.key_positions[None, None, :kv_len]
        return self.rule(p, q, key)

    def prepare(self, positions: Tensor, kv_len: int) -> None:
        """The mask of this step's block starts `positions` [S] (read: cache positions < kv_len)."""
        self.kv_len = kv_len
        if self.kind == "flex":
            self.start.copy_(positions)
            last = blocks_needed(positions + self.q_len - 1, self.max_len)
            if self.window is None:
                self.num_blocks[:, 0, 0] = last
                return
            # the first block holding a key some query of the block sees: the first query's window start
            first = ((positions - self.window + 1).clamp(min=0) // FLEX_BLOCK).to(torch.int32)
            self.num_blocks[:, 0, 0] = last - first
            self.indices[:, 0, 0] = (first[:, None] + self.block_ids).clamp(max=self.max_len // FLEX_BLOCK - 1)
            return
        s, t, rep = positions.shape[0], self.q_len, self.rep
        hidden = ~self.visible(positions, kv_len)
        bias = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill_(hidden, float("-inf"))
        self.bias = bias[:, None].expand(s, rep, t, kv_len).reshape(s, 1, rep * t, kv_len)  # folded rows

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, sinks: Tensor | None = None) -> Tensor:
        """q [S, T, heads, D] over k/v_cache [S, kv_heads, max_len, D] -> [S, T, heads * D];
        `sinks` [heads]: the layer's sink logits."""
        s, t, h, d = q.shape
        if not self.folded:  # flex, native GQA: the output comes back laid out as q, no copies
            o = self._flex(q.transpose(1, 2), k_cache, v_cache, sinks, enable_gqa=True)
            return o.transpose(1, 2).reshape(s, t, h * d)  # o [S, h, T, D], laid out as q: [S, T, h, D] in memory
        q = q.permute(0, 2, 1, 3).reshape(s, self.n_kv, self.rep * t, d)  # [S, kv, rep*T, D]
        if self.kind == "flex":
            o = self._flex(q, k_cache, v_cache, sinks)
        else:
            n = self.kv_len
            o = masked_attention(q, k_cache[:, :, :n], v_cache[:, :, :n], self.bias, scale=self.scale,
                                 score_cap=self.score_cap, sinks=None if sinks is None else self._sink_rows(sinks, t))
        # [S, kv, rep*T, D] -> [S, T, heads * D]; reshape, not view: CUDA's SDPA kernels may
        # return o with strides that do not merge
        return o.reshape(s, h, t, d).transpose(1, 2).reshape(s, t, h * d)

    def _flex(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, sinks: Tensor | None, enable_gqa: bool = False):
        """The flex kernel on q's layout; with sinks, each row's output times its share of a softmax
        that also holds the sink: sigmoid(lse - sink) (lse: the log-sum-exp of the row's real scores)."""
        if sinks is None:
            return self._kernel(q, k_cache, v_cache, block_mask=self.block_mask, scale=self.scale,
                                score_mod=self.score_mod, enable_gqa=enable_gqa)
        o, lse = output_and_lse(self._kernel(q, k_cache, v_cache, block_mask=self.block_mask, scale=self.scale,
                                             score_mod=self.score_mod, enable_gqa=enable_gqa, **LSE_REQUEST))
        share = torch.sigmoid(lse[..., None] - self._sink_rows(sinks, q.shape[2] // (1 if enable_gqa else self.rep)))
        return o * share.to(o.dtype)

    def _sink_rows(self, sinks: Tensor, t: int) -> Tensor:
        """sinks [heads] as the kernel's query rows: [1, kv, rep*T, 1] folded (row r*T + t is head
        j*rep + r), else [1, heads, 1, 1]."""
        if not self.folded:
            return sinks.float().view(1, self.n_heads, 1, 1)
        return sinks.float().view(self.n_kv, self.rep, 1).expand(self.n_kv, self.rep, t).reshape(1, self.n_kv, -1, 1)
