"""The causal-within-document BlockMask of packed rows against the rule evaluated on every pair."""

import random

import pytest
import torch

from dflash_train.utils.flex_masks import causal_document_block_mask, document_starts

from ..drafter.reference import effective_mask, random_packed_layout


def causal_document_ref(doc: torch.Tensor) -> torch.Tensor:
    """[R, S] -> [R, S, S]: q sees kv iff kv <= q in the same run of equal ids (padding, -1, is one run)."""
    R, S = doc.shape
    out = torch.zeros(R, S, S, dtype=torch.bool)
    for r in range(R):
        for q in range(S):
            kv = q
            while kv >= 0 and doc[r, kv] == doc[r, q]:
                out[r, q, kv] = True
                kv -= 1
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("tile,S", [(8, 61), (16, 64), (16, 70)])
def test_block_mask_is_exact(seed, tile, S):
    """Listed tiles never drop a visible key, tiles marked full are truly full, and the mask's
    own rule is the rule everywhere."""
    _, _, doc, _ = random_packed_layout(random.Random(seed), 3, S, max_docs=5)
    bm = causal_document_block_mask(doc, tile=tile)
    want = causal_document_ref(doc)
    assert torch.equal(effective_mask(bm, bm.mask_mod, 3, S, S), want)
    assert bm.seq_lengths == (S, S)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_a_sliding_window_keeps_the_last_window_keys_of_the_document(seed, window):
    """transformers' sliding-window rule (q - window < kv) on top of causal-within-document."""
    _, _, doc, _ = random_packed_layout(random.Random(seed), 2, 70, max_docs=4)
    bm = causal_document_block_mask(doc, tile=8, window=window)
    q, kv = torch.arange(70)[:, None], torch.arange(70)[None, :]
    want = causal_document_ref(doc) & (q - kv < window)
    assert torch.equal(effective_mask(bm, bm.mask_mod, 2, 70, 70), want)


def test_only_the_tiles_near_the_diagonal_are_listed_and_inner_ones_are_full():
    doc = torch.arange(8).repeat_interleave(32)[None]  # eight 32-token documents, tiles of 16
    bm = causal_document_block_mask(doc, tile=16)
    assert bm.kv_num_blocks[0, 0].tolist() == [1] * 16  # the diagonal tile: partial (causal)
    assert bm.full_kv_num_blocks[0, 0].tolist() == [0, 1] * 8  # a document's second tile sees its first whole
    assert torch.equal(effective_mask(bm, bm.mask_mod, 1, 256, 256), causal_document_ref(doc))


def test_document_starts_counts_the_padding_as_one_more_document():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1, -1], [2, 3, 3, 3, 3, 3, 3]])
    assert document_starts(doc).tolist() == [[0, 0, 0, 3, 3, 5, 5], [0, 1, 1, 1, 1, 1, 1]]
