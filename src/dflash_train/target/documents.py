"""The documents of packed rows as a right-padded batch: the target's attention runs there.

A packed row [R, S] holds several documents back to back, and a plain causal attention over
the row would let each document see the ones before it. The target's forward therefore
moves every document into a right-padded [D, L] batch for attention (or its whole forward, on
the Hugging Face path) and back. Both moves are gathers through index maps computed once per
batch on the CPU: a gather is one fast kernel, where writing through two index tensors
(`docs[doc, pos] = ...`) was the slowest kernel of a small target's step.

Slots that hold no token read a real token anyway, which is harmless: under causal attention
a real token never sees a later slot of its own document (a document's padding follows it),
and padded whole documents are never read back; the packed padding positions are zeroed by
the caller.

`round_shape` rounds D and L up to one of eight sizes per octave (at most 1/8 more slots):
kernels that build a plan per shape (cuDNN's attention) build few. The SmolLM2 recipe's five
epochs meet 42 shapes instead of 858 (`bench/document_shapes.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_train.utils.device import to_device_async


def round_up(n: int, per_octave: int = 8) -> int:
    """n rounded up to a multiple of 2**(floor(log2 n) - log2 per_octave): at most 1/per_octave
    more, and one of `per_octave` sizes per octave (n <= per_octave is kept)."""
    step = 1 << max(n.bit_length() - per_octave.bit_length(), 0)
    return -(-n // step) * step


@dataclass(frozen=True)
class DocumentLayout:
    """Where each token of packed [R, S] rows sits in the [D, L] batch of their documents."""

    to_docs: Tensor  # [D * L] the packed flat position each document slot reads
    to_packed: Tensor  # [R * S] the document slot (d * L + l) each packed position reads
    lengths: Tensor  # [D] tokens of each document (0 for documents added by round_shape)
    rows: int  # R
    row_len: int  # S
    D: int
    L: int

    def to(self, device: torch.device | None) -> DocumentLayout:
        """The maps on `device` (computed on the CPU copy of a batch, then pinned and copied
        without the host waiting: they never cost the GPU a host sync)."""
        if device is None:
            return self
        to_docs, to_packed, lengths = (to_device_async(t, device) for t in (self.to_docs, self.to_packed, self.lengths))
        return DocumentLayout(to_docs, to_packed, lengths, self.rows, self.row_len, self.D, self.L)

    def docs(self, t: Tensor) -> Tensor:
        """[R, S, *f] -> [D, L, *f]."""
        flat = t.reshape(self.rows * self.row_len, *t.shape[2:])
        return flat.index_select(0, self.to_docs).view(self.D, self.L, *t.shape[2:])

    def packed(self, t: Tensor) -> Tensor:
        """[D, L, *f] -> [R, S, *f]; packed padding positions hold some document slot's value."""
        flat = t.reshape(self.D * self.L, *t.shape[2:])
        return flat.index_select(0, self.to_packed).view(self.rows, self.row_len, *t.shape[2:])


def unpack_documents(document_ids: Tensor, position_ids: Tensor, *, round_shape: bool = False) -> DocumentLayout:
    """The layout of packed rows' documents ([R, S] ids, -1 for padding; each document's
    positions 0..n-1 in order). Documents are numbered 0..D-1 in the batch. Built where the ids
    live: the CPU copy of a batch costs no host sync (on a GPU, D and L are read back)."""
    R, S = document_ids.shape
    dev = document_ids.device
    flat_doc = document_ids.reshape(-1)
    real = torch.nonzero(flat_doc >= 0, as_tuple=True)[0]
    doc = flat_doc[real]
    pos = position_ids.reshape(-1)[real]
    D = int(doc.max()) + 1 if doc.numel() else 0
    L = int(pos.max()) + 1 if pos.numel() else 0
    lengths = torch.zeros(D, dtype=torch.long, device=dev).scatter_reduce(0, doc.long(), pos.long() + 1, reduce="amax")
    if round_shape and D:
        D, L = round_up(D), round_up(L)
        lengths = torch.cat([lengths, lengths.new_zeros(D - lengths.numel())])
    slot = doc.long() * L + pos.long()
    first = int(real[0]) if real.numel() else 0  # what empty slots read: a real token
    to_docs = torch.full((D * L,), first, dtype=torch.long, device=dev)
    to_docs[slot] = real
    to_packed = torch.full((R * S,), int(slot[0]) if slot.numel() else 0, dtype=torch.long, device=dev)
    to_packed[real] = slot
    return DocumentLayout(to_docs, to_packed, lengths, R, S, D, L)
