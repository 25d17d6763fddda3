"""FlexAttention's shared pieces, and block masks from per-query key ranges for packed rows.

What every FlexAttention user here needs (the target's packed forward, the drafter's masks,
the decoding engines' cache attention): its tile of 128 keys (`TILE`), the narrowest heads its
GPU kernels take (`FLEX_MIN_HEAD_DIM`), `BlockMask`, and how to ask it for each row's
log-sum-exp (`LSE_REQUEST`, `output_and_lse`).

A packed row holds whole documents one after another (positions 0, 1, 2, ... within each,
padding after the last), so the keys a query may see form one range [lo, hi) in closed form:
its document's first token up to itself for the target's causal attention, up to its anchor
for the drafter's context. From those ranges a few tensor ops list each query tile's key
tiles (no compilation, no element-wise mask evaluation): tiles inside every query's range are
"full" (no mask applied), tiles that touch some query's range "partial" (FlexAttention applies
the element-wise rule there), the rest are skipped. Tests check the lists against brute force.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_train.utils.device import to_device_async

try:  # FlexAttention exists on every torch this project supports; keep CPU import cheap
    from torch.nn.attention.flex_attention import BlockMask
except ImportError:  # pragma: no cover
    BlockMask = None  # type: ignore[assignment,misc]
try:  # torch >= 2.9: the log-sum-exp is an auxiliary output (`return_lse` is deprecated there)
    from torch.nn.attention.flex_attention import AuxRequest
    LSE_REQUEST: dict = {"return_aux": AuxRequest(lse=True)}
except ImportError:  # pragma: no cover - older torch
    LSE_REQUEST = {"return_lse": True}

TILE = 128  # FlexAttention's default block size
# FlexAttention's GPU kernels need heads at least this wide (narrower ones fail in Inductor's
# lowering: "NYI: embedding dimension of the query, key, and value must be at least 16").
FLEX_MIN_HEAD_DIM = 16
# and at most this many: wider heads (the engines' latent-attention head, 576 for DeepSeek-V3) take
# the dense kernel rather than a compile that may fail for lack of on-chip memory
FLEX_MAX_HEAD_DIM = 256


def output_and_lse(out: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, lse) of a flex_attention call made with `**LSE_REQUEST`, on any torch: the second
    item is the lse itself (older torch) or an auxiliary output holding it."""
    o, extra = out
    return o, extra if isinstance(extra, torch.Tensor) else extra.lse


def document_starts(document_ids: torch.Tensor) -> torch.Tensor:
    """[R, S] -> index of the first token of each position's document (contiguous documents;
    the padding after the last document, id -1, counts as one more)."""
    R, S = document_ids.shape
    idx = torch.arange(S, device=document_ids.device).expand(R, S)
    is_start = torch.ones_like(document_ids, dtype=torch.bool)
    is_start[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return torch.cummax(torch.where(is_start, idx, torch.zeros_like(idx)), dim=1).values


def range_tiles(lo: torch.Tensor, hi: torch.Tensor, num_keys: int, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query key ranges [lo, hi) ([R, Q]; empty when lo >= hi) -> (touched, full), each
    [R, Qb, Kb] bool over query tiles x key tiles: some query of the tile sees some key of the
    key tile (the union of the ranges), or every query sees every key (their intersection)."""
    R, Q = lo.shape
    Qb, Kb = -(-Q // tile), -(-num_keys // tile)
    pad = Qb * tile - Q
    big = num_keys + tile
    nonempty = lo < hi

    def per_tile(x: torch.Tensor, fill, reduce: str) -> torch.Tensor:
        return getattr(F.pad(x, (0, pad), value=fill).view(R, Qb, tile), reduce)(-1)

    lo_union = per_tile(torch.where(nonempty, lo, big), big, "amin")
    hi_union = per_tile(torch.where(nonempty, hi, -1), -1, "amax")
    lo_inter, hi_inter = per_tile(lo, -big, "amax"), per_tile(hi, big, "amin")
    all_nonempty = per_tile(nonempty, True, "all")
    t0 = torch.arange(Kb, device=lo.device) * tile  # first key of each key tile
    t1 = t0 + tile  # one past its last key
    touched = (t0 < hi_union[..., None]) & (t1 > lo_union[..., None])
    full = all_nonempty[..., None] & (t0 >= lo_inter[..., None]) & (t1 <= hi_inter[..., None])
    return touched, full


def _ordered_blocks(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, Qb, Kb] bool -> (counts [R, 1, Qb], indices [R, 1, Qb, Kb]) with selected blocks first."""
    counts = selected.sum(-1, dtype=torch.int32)
    order = torch.argsort((~selected).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


def tiles_block_mask(partial: torch.Tensor, full: torch.Tensor, mask_mod, seq_lengths: tuple[int, int], *,
                     tile: int = TILE, device: torch.device | None = None) -> "BlockMask":
    """The BlockMask of query tiles x key tiles ([R, Qb, Kb] bool each): `partial` tiles through
    `mask_mod`, `full` tiles whole, the rest skipped; its tile lists moved to `device`."""
    lists = (*_ordered_blocks(partial), *_ordered_blocks(full))
    if device is not None:
        lists = tuple(to_device_async(t, device) for t in lists)
    return BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=tile, mask_mod=mask_mod, seq_lengths=seq_lengths)


def causal_document_block_mask(document_ids: torch.Tensor, *, device: torch.device | None = None,
                               tile: int = TILE, window: int | None = None) -> "BlockMask":
    """Causal attention within each document of packed rows [R, S]: query q sees keys
    document_start(q) .. q, and with a sliding `window` only the last `window` of them
    (q - window < k, transformers' sliding-window rule). The padding after a row's last document
    attends among itself, so no query sees nothing (its output is discarded). Built where
    `document_ids` lives (the CPU copy of a batch: no host sync) and moved to `device` from
    pinned memory."""
    R, S = document_ids.shape
    lo = document_starts(document_ids)
    positions = torch.arange(S, device=lo.device).expand(R, S)
    if window:
        lo = torch.maximum(lo, positions - window + 1)
    touched, full = range_tiles(lo, positions + 1, S, tile)
    first_key = lo.to(torch.int32)
    if device is not None:
        first_key = to_device_async(first_key, device)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= first_key[b, q_idx]) & (kv_idx <= q_idx)

    return tiles_block_mask(touched & ~full, full, mask_mod, (S, S), tile=tile, device=device)
