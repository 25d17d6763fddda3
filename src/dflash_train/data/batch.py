"""The batch contract: `PackedBatch`, and `pack_documents` that builds one from token arrays.

Every producer of batches (the planner, synthetic benchmark batches, tests) hands the rest
of the system this object; see docs/architecture.md ("The batch contract"). Shapes: `R`
rows, `S` padded row length, `D` documents.

    input_ids     int64 [R, S]  token ids; padding is 0
    position_ids  int64 [R, S]  restarts at 0 at each document start; 0 on padding
    document_ids  int64 [R, S]  batch-local document index 0..D-1 (unique across rows), -1 on padding
    loss_mask     bool  [R, S]  True on tokens the drafter must learn to produce
    sample_ids    int64 [D]     dataset index of document d
    epoch, index  int           place in the plan: resume from (epoch, index + 1)

Documents are contiguous within a row and numbered in row-major order of placement, so
`document_ids` never decreases along a row and document `d` lives in exactly one row.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

Document = tuple[int, Sequence[int] | np.ndarray, Sequence[bool] | np.ndarray]
"""(sample_id, input_ids, loss_mask): one document to pack."""


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # int64 [R, S]
    position_ids: torch.Tensor  # int64 [R, S]
    document_ids: torch.Tensor  # int64 [R, S]
    loss_mask: torch.Tensor  # bool [R, S]
    sample_ids: torch.Tensor  # int64 [D]
    epoch: int = 0
    index: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.document_ids >= 0).sum())

    @property
    def num_documents(self) -> int:
        return int(self.sample_ids.numel())

    def _map(self, fn) -> "PackedBatch":
        return replace(
            self,
            input_ids=fn(self.input_ids),
            position_ids=fn(self.position_ids),
            document_ids=fn(self.document_ids),
            loss_mask=fn(self.loss_mask),
            sample_ids=fn(self.sample_ids),
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PackedBatch":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "PackedBatch":
        return self._map(lambda t: t.pin_memory())

    def pad_to(self, rows: int, length: int) -> "PackedBatch":
        """Pad to exactly [rows, length] (fixed shapes for compiled mode).

        Padding is input 0, position 0, document -1, loss False. Never shrinks: a batch
        larger than the target shape is an error (it would drop real tokens)."""
        r, s = self.shape
        if rows < r or length < s:
            raise ValueError(f"cannot pad a [{r}, {s}] batch to [{rows}, {length}]: that would drop tokens")
        if (rows, length) == (r, s):
            return self

        def pad(t: torch.Tensor, value) -> torch.Tensor:
            out = torch.full((rows, length), value, dtype=t.dtype, device=t.device)
            out[:r, :s] = t
            return out

        return replace(
            self,
            input_ids=pad(self.input_ids, 0),
            position_ids=pad(self.position_ids, 0),
            document_ids=pad(self.document_ids, -1),
            loss_mask=pad(self.loss_mask, False),
        )

    def validate(self) -> None:
        """Check the contract (dtypes, shapes, layout). Cheap enough for tests and debugging."""
        r, s = self.shape
        for name, dtype in (("input_ids", torch.int64), ("position_ids", torch.int64),
                            ("document_ids", torch.int64), ("loss_mask", torch.bool)):
            t = getattr(self, name)
            if t.dtype != dtype or tuple(t.shape) != (r, s):
                raise ValueError(f"{name}: expected {dtype} [{r}, {s}], got {t.dtype} {list(t.shape)}")
        if self.sample_ids.dtype != torch.int64 or self.sample_ids.dim() != 1:
            raise ValueError("sample_ids must be int64 [D]")
        pad = self.document_ids < 0
        if (self.input_ids[pad] != 0).any() or (self.position_ids[pad] != 0).any() or self.loss_mask[pad].any():
            raise ValueError("padding must be input 0, position 0, loss False")
        docs = self.document_ids[~pad]
        if docs.numel() and (docs.max() >= self.sample_ids.numel()):
            raise ValueError("document_ids out of range of sample_ids")


def _check_placement(docs: Sequence[Document], rows: Sequence[Sequence[int]]) -> list[int]:
    """Every document placed exactly once, its ids and loss mask of one length: the lengths."""
    placed = [i for row in rows for i in row]
    if sorted(placed) != list(range(len(docs))):
        raise ValueError("rows must place every document exactly once")
    lengths = [len(doc[1]) for doc in docs]
    bad = next((i for i, doc in enumerate(docs) if len(doc[2]) != lengths[i]), None)
    if bad is not None:
        raise ValueError(f"document {docs[bad][0]}: input_ids and loss_mask lengths differ")
    return lengths


def pack_documents(
    docs: Sequence[Document],
    rows: Sequence[Sequence[int]] | None = None,
    *,
    row_length: int | None = None,
    num_rows: int | None = None,
    epoch: int = 0,
    index: int = 0,
) -> PackedBatch:
    """Build a PackedBatch from token arrays.

    docs:       (sample_id, input_ids, loss_mask) per document; the arrays are 1-D and of
                equal length (loss_mask truthy where the drafter must learn the token).
    rows:       which documents go in which row, as positions in `docs`, in order; each
                document must appear exactly once. Default: one document per row.
    row_length: padded length S; default the longest row. Smaller than a row is an error.
    num_rows:   padded row count R (extra rows are all padding); default len(rows).

    Documents are numbered 0..D-1 in row-major order of placement, so `sample_ids[d]` is
    the sample id of the d-th placed document (not necessarily `docs[d]`).
    """
    if rows is None:
        rows = [[i] for i in range(len(docs))]
    lengths = _check_placement(docs, rows)
    row_lens = [sum(lengths[i] for i in row) for row in rows]
    s = max(row_lens, default=0) if row_length is None else row_length
    r = len(rows) if num_rows is None else num_rows
    if s < max(row_lens, default=0) or r < len(rows):
        raise ValueError(f"rows of up to {max(row_lens, default=0)} tokens x {len(rows)} rows do not fit [{r}, {s}]")

    input_ids = np.zeros((r, s), dtype=np.int64)
    position_ids = np.zeros((r, s), dtype=np.int64)
    document_ids = np.full((r, s), -1, dtype=np.int64)
    loss_mask = np.zeros((r, s), dtype=bool)
    sample_ids = np.empty(len(lengths), dtype=np.int64)
    d = 0
    for ri, row in enumerate(rows):
        col = 0
        for i in row:
            sid, ids, mask = docs[i]
            n = lengths[i]
            input_ids[ri, col:col + n] = np.asarray(ids)
            position_ids[ri, col:col + n] = np.arange(n)
            document_ids[ri, col:col + n] = d
            loss_mask[ri, col:col + n] = np.asarray(mask, dtype=bool)
            sample_ids[d] = sid
            d += 1
            col += n
    return PackedBatch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        document_ids=torch.from_numpy(document_ids),
        loss_mask=torch.from_numpy(loss_mask),
        sample_ids=torch.from_numpy(sample_ids),
        epoch=epoch,
        index=index,
    )
