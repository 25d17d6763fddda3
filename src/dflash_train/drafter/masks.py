"""The DFlash attention mask: one rule, two materialisations.

Queries are block tokens (block j, slot k -> query index j*B + k); keys are the S
context positions followed by the N*B block tokens. The rule (docs/dflash-spec.md):

* context key s is visible iff the anchor is valid, document_ids[s] == document_ids[a_j],
  s < a_j (strictly: the anchor's own target state does not exist yet at inference), and
  for a sliding-window layer (position_ids[a_j] + k) - position_ids[s] < W;
* block key (j', k') is visible iff j' == j and, for a layer causal within the block,
  k' <= k. Blocks never see each other; an invalid anchor sees only its own block.

`make_mask_mod` states the rule. On CPU, where FlexAttention has no backward, it is
evaluated on broadcast index grids to give a dense boolean mask for SDPA. On GPU,
FlexAttention gets a BlockMask built from the rule's closed form for our batch layout
(`context_ranges`: per query one range of context keys, one of block keys), which lists
the key tiles and decides the partial ones element-wise (`range_mask_mod`); tests check
both against a brute-force evaluation of the rule.
"""

from __future__ import annotations

from typing import Callable, Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dflash_train.utils.compile import compiled_once
from dflash_train.utils.flex_masks import TILE, BlockMask, document_starts, range_tiles, tiles_block_mask

# A dense bool tensor [R, Q, S+Q] (True = may attend) or a FlexAttention BlockMask.
AttentionMask = Union[torch.Tensor, "BlockMask"]
MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def make_mask_mod(
    document_ids: torch.Tensor,  # [R, S] int64, -1 on padding
    position_ids: torch.Tensor,  # [R, S] int64
    anchors: torch.Tensor,  # [R, N] int64
    valid: torch.Tensor,  # [R, N] bool
    block_size: int,
    *,
    sliding_window: int | None = None,
    causal_in_block: bool = False,
) -> MaskMod:
    S = document_ids.shape[1]
    B = block_size
    anchor_doc = torch.gather(document_ids, 1, anchors)  # [R, N]
    anchor_pos = torch.gather(position_ids, 1, anchors)  # [R, N]

    def mask_mod(b, h, q_idx, kv_idx):
        j = q_idx // B
        k = q_idx % B
        is_ctx = kv_idx < S
        s = torch.clamp(kv_idx, max=S - 1)
        ctx_ok = (
            is_ctx
            & valid[b, j]
            & (document_ids[b, s] == anchor_doc[b, j])
            & (s < anchors[b, j])
        )
        if sliding_window is not None:
            ctx_ok = ctx_ok & (anchor_pos[b, j] + k - position_ids[b, s] < sliding_window)
        # Block-key index; negative for context keys, which the ~is_ctx term excludes.
        # (Clamping it at 0 instead trips an inductor bug in compiled create_block_mask.)
        blk = kv_idx - S
        blk_ok = (~is_ctx) & (blk // B == j)
        if causal_in_block:
            blk_ok = blk_ok & (blk % B <= k)
        return ctx_ok | blk_ok

    return mask_mod


def dense_attention_mask(
    document_ids: torch.Tensor,
    position_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    *,
    sliding_window: int | None = None,
    causal_in_block: bool = False,
) -> torch.Tensor:
    """BoolTensor[R, N*B, S + N*B], True = may attend; keys: S context positions, then blocks."""
    R, S = document_ids.shape
    Q = anchors.shape[1] * block_size
    mask_mod = make_mask_mod(
        document_ids, position_ids, anchors, valid, block_size,
        sliding_window=sliding_window, causal_in_block=causal_in_block,
    )
    dev = document_ids.device
    b = torch.arange(R, device=dev)[:, None, None]
    q = torch.arange(Q, device=dev)[None, :, None]
    kv = torch.arange(S + Q, device=dev)[None, None, :]
    return mask_mod(b, None, q, kv).expand(R, Q, S + Q)


def context_ranges(
    document_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query (block j, slot k): the visible context keys as a range [lo, hi), [R, N*B] each.

    Closed form of the mask rule for the batch layout (documents contiguous in a row,
    positions 0, 1, 2, ... within each): keys of the anchor's document before the anchor,
    and within the window pos[a] + k - pos[s] < W, i.e. s >= a + k - W + 1.
    Empty ranges have lo == hi.
    """
    R, N = anchors.shape
    start = torch.gather(document_starts(document_ids), 1, anchors)  # [R, N]
    k = torch.arange(block_size, device=anchors.device)
    lo = start[..., None].expand(R, N, block_size)
    hi = anchors[..., None].expand(R, N, block_size)
    if sliding_window is not None:
        lo = torch.maximum(lo, anchors[..., None] + k - sliding_window + 1)
    lo = torch.where(valid[..., None], lo.clamp(max=hi), hi)
    return lo.reshape(R, N * block_size), hi.reshape(R, N * block_size)


def range_mask_mod(lo: torch.Tensor, hi: torch.Tensor, S: int, block_size: int, *,
                   causal_in_block: bool = False) -> MaskMod:
    """The rule in the closed form of `context_ranges` (`lo`, `hi` [R, Q]): two key ranges per
    query, its context keys [lo, hi) (hi <= S) and its own block's keys. The analytic
    BlockMask hands it to FlexAttention for the partial tiles, where it runs on every element
    (twice in the backward): two per-query bounds instead of each key's document and position."""
    B = block_size

    def mask_mod(b, h, q_idx, kv_idx):
        ctx_ok = (kv_idx >= lo[b, q_idx]) & (kv_idx < hi[b, q_idx])
        block_lo = S + q_idx - q_idx % B  # the keys of the query's block: [block_lo, block_lo + B)
        block_hi = S + q_idx + 1 if causal_in_block else block_lo + B
        return ctx_ok | ((kv_idx >= block_lo) & (kv_idx < block_hi))

    return mask_mod


def flex_block_mask(
    document_ids: torch.Tensor,
    position_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    *,
    sliding_window: int | None = None,
    causal_in_block: bool = False,
    builder: str = "analytic",
    compile: bool = True,
    tile: int = TILE,
) -> "BlockMask":
    """FlexAttention BlockMask of the same rule. Sorted anchors make it block-sparse.

    builder="analytic" (default) lists each query tile's key tiles from the closed-form
    ranges of `context_ranges` with a few tensor ops (no compilation, microseconds);
    tiles it cannot prove fully visible are marked partial, where FlexAttention applies
    `range_mask_mod`, the same closed form element-wise (tests check both against a
    brute-force evaluation of the rule on random packed layouts).
    builder="create_block_mask" evaluates `make_mask_mod` on the whole grid instead
    (`_compile=True` compiles it; at S=4096, 512 anchors its compilation did not finish
    in 4 minutes on torch 2.11, which is why it is not the default).
    """
    R, S = document_ids.shape
    N = anchors.shape[1]
    Q = N * block_size
    if builder == "create_block_mask":
        mask_mod = make_mask_mod(
            document_ids, position_ids, anchors, valid, block_size,
            sliding_window=sliding_window, causal_in_block=causal_in_block,
        )
        return create_block_mask(mask_mod, R, None, Q, S + Q, device=document_ids.device, _compile=compile)
    if builder != "analytic":
        raise ValueError(f"unknown block-mask builder {builder!r}")
    dev = document_ids.device
    Qb, Kb = -(-Q // tile), -(-(S + Q) // tile)
    lo, hi = context_ranges(document_ids, anchors, valid, block_size, sliding_window)
    ctx_touch, full = range_tiles(lo, hi, S + Q, tile)
    t0 = torch.arange(Kb, device=dev) * tile  # first key of each key tile
    t1 = t0 + tile  # one past its last key
    # block keys: the tile's queries belong to blocks q0 // B .. q1 // B
    q0 = torch.arange(Qb, device=dev) * tile
    q1 = torch.clamp(q0 + tile - 1, max=Q - 1)
    key_lo = S + (q0 // block_size) * block_size
    key_hi = S + (q1 // block_size + 1) * block_size
    blk_touch = (t0 < key_hi[:, None]) & (t1 > key_lo[:, None])
    partial = (ctx_touch | blk_touch) & ~full
    mask_mod = range_mask_mod(lo.to(torch.int32), hi.to(torch.int32), S, block_size, causal_in_block=causal_in_block)
    return tiles_block_mask(partial, full, mask_mod, (Q, S + Q), tile=tile)


def build_layer_masks(
    cfg,  # DrafterConfig
    document_ids: torch.Tensor,
    position_ids: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    *,
    backend: str,
) -> list[AttentionMask]:
    """One mask per drafter layer; layers with the same (window, causal) share one object."""
    if backend not in ("dense", "flex"):
        raise ValueError(f"attention backend must be 'dense' or 'flex', got {backend!r}")
    build = flex_block_mask if backend == "flex" else dense_attention_mask
    by_variant = {
        variant: build(
            document_ids, position_ids, anchors, valid, cfg.block_size,
            sliding_window=variant[0], causal_in_block=variant[1],
        )
        for variant in cfg.mask_variants()
    }
    return [by_variant[(cfg.window_of(i), cfg.causal_in_block_of(i))] for i in range(cfg.num_hidden_layers)]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """q [R, h, Q, d], k/v [R, g, S+Q, d] (g divides h) -> [R, h, Q, d]."""
    if q.dtype != v.dtype or k.dtype != v.dtype:  # RoPE in float32 under autocast: match v
        q, k = q.to(v.dtype), k.to(v.dtype)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    # compiled (eager FlexAttention materialises the full score matrix); shapes vary: dynamic
    flex = compiled_once(flex_attention, dynamic=None, fullgraph=False)
    return flex(q, k, v, block_mask=mask, enable_gqa=True)
