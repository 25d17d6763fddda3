"""The DFlash drafter's proposal forward on static per-slot caches, for the speculative engine.

It reads the weights of a `DFlashDrafter` (nothing is copied) and repeats its op sequence
(drafter/model.py), with the context K/V of every layer kept in a static cache:

    k_cache, v_cache: [layers, slots, kv_heads, max_len, head_dim]

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

from dflash_train.drafter.model import DFlashDrafter
from dflash_train.target.ops import apply_rope, rms_norm


class DraftSource(Protocol):
    """What proposes drafts inside the engine (generate/spec_engine.py): `StaticDrafter` or a
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
    """References to one drafter layer's weights, grouped as the arguments of `_block_qkv` and
    `_post_attention` (plain tensors: a compiled version serves all layers)."""

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = (layer.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight,
                    attn.q_norm.weight, attn.k_norm.weight)
        self.post = (attn.o_proj.weight, layer.post_attention_layernorm.weight,
                     mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
        self.eps = float(layer.input_layernorm.eps)
        self.qk_eps = float(attn.q_norm.eps)
        self.post_eps = float(layer.post_attention_layernorm.eps)


def _block_qkv(
    x: Tensor, cos: Tensor, sin: Tensor, ln_w: Tensor, wq: Tensor, wk: Tensor, wv: Tensor, qn_w: Tensor, kn_w: Tensor,
    *, eps: float, qk_eps: float, n_heads: int, n_kv: int, head_dim: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Residual x [S, B, H] -> q [S, B, h, d], k/v [S, B, g, d] of the block (normed, rotated)."""
    h = _norm(x, ln_w, eps)
    lead = h.shape[:-1]
    q = _norm(F.linear(h, wq).view(*lead, n_heads, head_dim), qn_w, qk_eps)
    k = _norm(F.linear(h, wk).view(*lead, n_kv, head_dim), kn_w, qk_eps)
    v = F.linear(h, wv).view(*lead, n_kv, head_dim)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _context_kv(
    ctx: Tensor, cos: Tensor, sin: Tensor, w_kv: Tensor, kn_w: Tensor, *, qk_eps: float, n_layers: int, n_kv: int,
    head_dim: int,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Projected context ctx [S, T, H] -> k/v [S, T, layers, g, d] of every layer (the context
    never passes through q). w_kv [layers*2*g*d, H]: each layer's k_proj then v_proj rows;
    kn_w [layers, 1, d]: the k_norm weights; cos/sin [S, T, 1, 1, d]."""
    kv = F.linear(ctx, w_kv).view(*ctx.shape[:-1], n_layers, 2, n_kv, head_dim)
    k = _norm(kv[..., 0, :, :], kn_w, qk_eps)
    return apply_rope(k, cos, sin), kv[..., 1, :, :]


def _post_attention(
    x: Tensor, attn_out: Tensor, wo: Tensor, ln2_w: Tensor, wg: Tensor, wu: Tensor, wd: Tensor, *, eps: float
) -> Tensor:
    x = x + F.linear(attn_out, wo)
    h = _norm(x, ln2_w, eps)
    return x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)


class StaticDrafter:
    """DFlash proposals for `slots` sequences of at most `max_len` positions (see module doc).

    `drafter` must already be on the target's device, in the dtype it should run in."""

    def __init__(self, drafter: DFlashDrafter, embed_w: Tensor, lm_head_w: Tensor, slots: int, max_len: int) -> None:
        cfg = drafter.config
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

        shape = (len(self.layers), slots, self.n_kv, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        positions = torch.arange(max_len, device=self.device)
        with torch.no_grad():  # the drafter's own rotary module: the same values as in training
            cos, sin = drafter.rotary(positions[None], self.dtype)  # [1, 1, max_len, d]
        self.cos, self.sin = cos[0, 0].contiguous(), sin[0, 0].contiguous()  # [max_len, d]
        self.key_positions = positions
        self.rows = torch.arange(slots, device=self.device)
        self.variants = [(cfg.window_of(i), cfg.causal_in_block_of(i)) for i in range(cfg.num_hidden_layers)]
        # The per-layer pieces; an engine may swap in torch.compile'd versions.
        self.block_qkv: Callable[..., tuple[Tensor, Tensor, Tensor]] = _block_qkv
        self.context_kv: Callable[..., tuple[Tensor, Tensor]] = _context_kv
        self.post_attention: Callable[..., Tensor] = _post_attention

    @torch.no_grad()
    def refresh(self, source: DFlashDrafter) -> None:
        """Take the current weights of `source` (the same drafter, e.g. in training): copied into
        the module read here (nothing to copy when it is `source` itself) and the concatenated
        context weights rebuilt in place, so captured CUDA graphs replay with the new weights."""
        if source is not self.module:
            for (name, dst), (_, src) in zip(self.module.named_parameters(), source.named_parameters(), strict=True):
                dst.copy_(src)
        attns = [layer.self_attn for layer in self.module.layers]
        self.context_w.copy_(torch.cat([torch.cat([a.k_proj.weight, a.v_proj.weight]) for a in attns]))
        self.context_kn_w.copy_(torch.stack([a.k_norm.weight for a in attns])[:, None, :])

    def kv_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def _write_context(self, taps: Tensor, start: Tensor, rows: Tensor, context_kv: Callable[..., tuple]) -> None:
        """Context K/V of taps [R, T, n*H] at positions start[r] + 0..T-1 of cache rows `rows` [R]."""
        t = taps.shape[1]
        grid = start[:, None] + self.key_positions[None, :t]  # [R, T]
        ctx = _norm(F.linear(taps.to(self.dtype), self.fc_w), self.hidden_norm_w, self.hidden_norm_eps)  # [R, T, H]
        cos, sin = self.cos[grid][:, :, None, None, :], self.sin[grid][:, :, None, None, :]  # [R, T, 1, 1, d]
        k, v = context_kv(ctx, cos, sin, self.context_w, self.context_kn_w, qk_eps=self.context_eps,
                          n_layers=len(self.layers), n_kv=self.n_kv, head_dim=self.head_dim)  # [R, T, layers, g, d]
        # element (r, t) of the two advanced indices -> all layers, cache row rows[r], position grid[r, t]
        self.k_cache[:, rows[:, None], :, grid] = k
        self.v_cache[:, rows[:, None], :, grid] = v

    def start(self, ids: Tensor, lengths: Tensor, slot_ids: Tensor, taps: Tensor) -> None:
        """After a prefill: the prompts' taps [n, T, n*H] (right padded) become the context of
        cache rows `slot_ids` [n] at positions 0..T-1 (padding rows: garbage past the length,
        never read). `ids`/`lengths` are unused here (test doubles read them). Eager and
        uncompiled: prompt widths vary, and a compiled function would recompile for each."""
        self._write_context(taps, torch.zeros_like(slot_ids), slot_ids, _context_kv)

    def extend(self, taps: Tensor, start: Tensor) -> None:
        """Taps [S, B, n*H] of the block verified last, at positions start[s] + 0..B-1 of every slot."""
        self._write_context(taps, start, self.rows, self.context_kv)

    def _bias(self, positions: Tensor, kv_len: int, window: int | None, causal: bool) -> Tensor:
        """Additive mask [S, 1, rep*B, kv_len] of one (window, causal_in_block) layer variant."""
        s, b = positions.shape[0], self.block_size
        rep = self.n_heads // self.n_kv
        p = positions[:, None, None]  # [S, 1, 1] the block's first position (the anchor's)
        k = self.key_positions[None, :b, None]  # [1, B, 1] slot within the block
        key = self.key_positions[None, None, :kv_len]  # [1, 1, L] key position
        context = key < p
        if window is not None:
            context = context & (p + k - key < window)
        in_block = (key >= p) & (key < p + b)
        if causal:
            in_block = in_block & (key - p <= k)
        visible = context | in_block  # [S, B, L]
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        return bias[:, None].expand(s, rep, b, kv_len).reshape(s, 1, rep * b, kv_len)

    def block_hidden(self, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """Final normed hidden states [S, B, H] of the blocks [tokens[s], MASK, ...] at positions[s]."""
        s, b = tokens.shape[0], self.block_size
        rep = self.n_heads // self.n_kv
        ids = torch.cat([tokens[:, None], torch.full_like(tokens, self.mask_token_id)[:, None].expand(s, b - 1)], 1)
        x = F.embedding(ids, self.embed_w).to(self.dtype)  # [S, B, H]
        grid = positions[:, None] + self.key_positions[None, :b]  # [S, B]
        cos, sin = self.cos[grid][:, :, None, :], self.sin[grid][:, :, None, :]  # [S, B, 1, d]
        biases = {v: self._bias(positions, kv_len, *v) for v in dict.fromkeys(self.variants)}
        rows = self.rows[:s, None]
        for i, lay in enumerate(self.layers):
            q, k, v = self.block_qkv(x, cos, sin, *lay.qkv, eps=lay.eps, qk_eps=lay.qk_eps, n_heads=self.n_heads,
                                     n_kv=self.n_kv, head_dim=self.head_dim)
            kc, vc = self.k_cache[i], self.v_cache[i]
            kc[rows, :, grid] = k
            vc[rows, :, grid] = v
            # GQA without repeating the cache (as StaticDecoder.verify): row r*B + k of kv head j
            q = q.permute(0, 2, 1, 3).reshape(s, self.n_kv, rep * b, self.head_dim)
            bias = biases[self.variants[i]]
            o = F.scaled_dot_product_attention(q, kc[:, :, :kv_len], vc[:, :, :kv_len], attn_mask=bias)
            o = o.view(s, self.n_heads, b, self.head_dim).transpose(1, 2).reshape(s, b, self.n_heads * self.head_dim)
            x = self.post_attention(x, o, *lay.post, eps=lay.post_eps)
        return _norm(x, self.norm_w, self.norm_eps)

    def propose(self, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """Drafts [S, B-1] following tokens [S] (each slot's last committed token, at positions [S]).
        The caller guarantees max(positions) + B <= kv_len <= max_len."""
        hidden = self.block_hidden(tokens, positions, kv_len)[:, 1:]  # slots 1..B-1: the tokens after the anchor
        return F.linear(hidden.to(self.lm_head_w.dtype), self.lm_head_w).argmax(-1)
