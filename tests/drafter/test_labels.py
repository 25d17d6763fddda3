import random

import pytest
import torch

from dflash_train.drafter.anchors import select_anchors
from torch.overrides import TorchFunctionMode

from dflash_train.drafter.labels import (
    IGNORE,
    build_block_labels,
    needed_label_rows,
    predecessor_positions,
    target_block_labels,
)

from .reference import labels_ref, random_packed_layout


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("B", [2, 4, 16])
def test_data_labels_match_brute_force(seed, B):
    ids, _, doc, loss = random_packed_layout(random.Random(seed), 3, 45)
    anchors, valid = select_anchors(loss, doc, 9, B, generator=torch.Generator().manual_seed(seed))
    labels, lv = build_block_labels(ids, doc, loss, anchors, valid, B)
    want_labels, want_lv = labels_ref(ids, doc, loss, anchors, valid, B)
    assert torch.equal(lv, want_lv)
    assert torch.equal(labels, want_labels)


def test_labels_never_cross_documents_or_use_slot_zero():
    # one row: doc 0 = positions 0..5, doc 1 = 6..9, then padding; every token is a loss token
    doc = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1, -1]])
    ids = torch.arange(100, 112)[None]
    loss = torch.ones_like(doc, dtype=torch.bool)
    anchors = torch.tensor([[3, 7]])
    valid = torch.tensor([[True, True]])
    labels, lv = build_block_labels(ids, doc, loss, anchors, valid, 5)
    # anchor 3: slots 1, 2 -> tokens at 4, 5; slot 3 would be position 6 (next document)
    assert labels[0, 0].tolist() == [IGNORE, 104, 105, IGNORE, IGNORE]
    # anchor 7: slots 1, 2 -> 8, 9; 10 is padding
    assert labels[0, 1].tolist() == [IGNORE, 108, 109, IGNORE, IGNORE]
    assert not lv[..., 0].any()


def test_labels_respect_loss_mask_and_row_end():
    doc = torch.zeros((1, 6), dtype=torch.long)
    ids = torch.arange(6)[None] + 10
    loss = torch.tensor([[False, True, False, True, True, True]])
    labels, lv = build_block_labels(ids, doc, loss, torch.tensor([[0, 3]]), torch.tensor([[True, True]]), 4)
    assert labels[0, 0].tolist() == [IGNORE, 11, IGNORE, 13]  # position 2 is a prompt token
    assert labels[0, 1].tolist() == [IGNORE, 14, 15, IGNORE]  # position 6 is past the row


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fixed_shape", [False, True])  # fixed shape: many overlapping blocks
@pytest.mark.parametrize("chunk_rows", [3, 7, 8192])
def test_target_labels_are_greedy_of_the_predecessor_position(seed, fixed_shape, chunk_rows):
    rng = random.Random(seed)
    ids, _, doc, loss = random_packed_layout(rng, 2, 30)
    B, H, V, N = 4, 8, 37, 12
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 30, H, generator=g)
    w = torch.randn(V, H, generator=g)
    anchors, valid = select_anchors(loss, doc, N, B, generator=g, fixed_shape=fixed_shape)
    labels, lv = target_block_labels(hidden, w, doc, loss, anchors, valid, B, chunk_rows=chunk_rows)
    _, want_lv = labels_ref(ids, doc, loss, anchors, valid, B)
    assert torch.equal(lv, want_lv)
    for r in range(2):
        for j in range(anchors.shape[1]):
            for k in range(B):
                if want_lv[r, j, k]:
                    p = int(anchors[r, j]) + k - 1
                    assert labels[r, j, k] == int(torch.argmax(w @ hidden[r, p]))
                else:
                    assert labels[r, j, k] == IGNORE


def needed_positions_ref(anchors, lv, S):
    """The set of flat positions r * S + a_j + k - 1 of every valid label slot k."""
    R, N, B = lv.shape
    return sorted({r * S + int(anchors[r, j]) + k - 1
                   for r in range(R) for j in range(N) for k in range(1, B) if lv[r, j, k]})


@pytest.mark.parametrize("seed", range(6))
def test_logits_are_computed_once_per_distinct_needed_position(seed):
    ids, _, doc, loss = random_packed_layout(random.Random(seed), 3, 40)
    B, H, V = 5, 6, 23
    g = torch.Generator().manual_seed(seed)
    anchors, valid = select_anchors(loss, doc, 16, B, generator=g, fixed_shape=True)
    _, lv = labels_ref(ids, doc, loss, anchors, valid, B)
    want = needed_positions_ref(anchors, lv, 40)
    assert needed_label_rows(predecessor_positions(anchors, B, 40), lv, 40).nonzero().squeeze(1).tolist() == want
    # the LM head multiplies exactly those rows, nothing else
    shapes = []

    class RecordMatmuls(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.matmul, torch.Tensor.__matmul__, torch.matmul):
                shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    with RecordMatmuls():
        target_block_labels(torch.randn(3, 40, H, generator=g), torch.randn(V, H, generator=g), doc, loss,
                            anchors, valid, B)
    assert shapes == [(len(want), H)]
    assert len(want) < int(lv[..., 1:].sum())  # overlapping blocks share positions


def test_target_labels_without_any_valid_label():
    doc = torch.zeros((1, 8), dtype=torch.long)
    loss = torch.zeros((1, 8), dtype=torch.bool)
    anchors, valid = torch.tensor([[0, 3]]), torch.tensor([[False, False]])
    labels, lv = target_block_labels(torch.randn(1, 8, 4), torch.randn(9, 4), doc, loss, anchors, valid, 4)
    assert not lv.any() and bool((labels == IGNORE).all())
