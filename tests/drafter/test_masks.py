import random

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask, flex_attention

from dflash_train.drafter.anchors import select_anchors
from dflash_train.drafter.masks import dense_attention_mask, flex_block_mask, make_mask_mod

from .reference import effective_mask, mask_ref, random_packed_layout

B = 4


def _layout(seed, R=2, S=37, N=7):
    rng = random.Random(seed)
    ids, pos, doc, loss = random_packed_layout(rng, R, S)
    g = torch.Generator().manual_seed(seed)
    anchors, valid = select_anchors(loss, doc, N, B, generator=g)
    return ids, pos, doc, loss, anchors, valid


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("window", [None, 3, 9])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_mask_matches_brute_force(seed, window, causal):
    _, pos, doc, _, anchors, valid = _layout(seed)
    got = dense_attention_mask(doc, pos, anchors, valid, B, sliding_window=window, causal_in_block=causal)
    want = mask_ref(doc, pos, anchors, valid, B, window, causal)
    assert got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("window,causal", [(None, False), (5, True)])
def test_flex_path_evaluates_the_same_mask_mod(seed, window, causal):
    """FlexAttention evaluates mask_mod under vmap on scalar indices: same mask as dense."""
    _, pos, doc, _, anchors, valid = _layout(seed)
    R, S = doc.shape
    Q = anchors.shape[1] * B
    mm = make_mask_mod(doc, pos, anchors, valid, B, sliding_window=window, causal_in_block=causal)
    via_vmap = create_mask(mm, R, 1, Q, S + Q, device="cpu")[:, 0]
    assert torch.equal(via_vmap, mask_ref(doc, pos, anchors, valid, B, window, causal))
    # and FlexAttention's forward with the BlockMask equals SDPA with the dense mask
    bm = flex_block_mask(doc, pos, anchors, valid, B, sliding_window=window, causal_in_block=causal, compile=False)
    dense = dense_attention_mask(doc, pos, anchors, valid, B, sliding_window=window, causal_in_block=causal)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, 4, Q, 8, generator=g)
    k = torch.randn(R, 2, S + Q, 8, generator=g)
    v = torch.randn(R, 2, S + Q, 8, generator=g)
    out_flex = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    out_dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None], enable_gqa=True)
    torch.testing.assert_close(out_flex, out_dense, atol=1e-5, rtol=1e-5)


def test_mask_rules_by_hand():
    """One row, two documents; checks the individual rules on a case small enough to read."""
    #        pos:  0 1 2 3 | 0 1 2
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2]])
    anchors = torch.tensor([[2, 5, 6]])
    valid = torch.tensor([[True, True, False]])
    Bh = 2
    m = dense_attention_mask(doc, pos, anchors, valid, Bh, sliding_window=None, causal_in_block=True)
    S = 7
    # block 0 (anchor 2, doc 0): context 0, 1 only (strictly before the anchor, same doc)
    assert m[0, 0, :S].tolist() == [True, True, False, False, False, False, False]
    # block 1 (anchor 5, doc 1): context 4 only; never doc 0
    assert m[0, 2, :S].tolist() == [False, False, False, False, True, False, False]
    # causal in block: slot 0 sees slot 0 of its block only; slot 1 sees slots 0 and 1
    assert m[0, 2, S:].tolist() == [False, False, True, False, False, False]
    assert m[0, 3, S:].tolist() == [False, False, True, True, False, False]
    # invalid anchor: no context at all, only its own block
    assert not m[0, 4, :S].any() and m[0, 5, S:].tolist() == [False, False, False, False, True, True]
    # window 2: slot k of anchor 2 sees s iff (2 + k) - pos[s] < 2
    mw = dense_attention_mask(doc, pos, anchors, valid, Bh, sliding_window=2, causal_in_block=False)
    assert mw[0, 0, :S].tolist() == [False, True, False, False, False, False, False]
    assert mw[0, 1, :S].tolist() == [False, False, False, False, False, False, False]
    # bidirectional within the block
    assert mw[0, 0, S:].tolist() == [True, True, False, False, False, False]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("window,causal", [(None, False), (None, True), (7, True), (20, False)])
@pytest.mark.parametrize("tile,B,N", [(16, 4, 12), (8, 4, 6), (16, 5, 9)])
def test_analytic_block_mask_is_exact(seed, window, causal, tile, B, N):
    """The tile lists never drop a visible key, and tiles marked full are truly full."""
    rng = random.Random(seed)
    ids, pos, doc, loss = random_packed_layout(rng, 2, 70, max_docs=3)
    anchors, valid = select_anchors(loss, doc, N, B, generator=torch.Generator().manual_seed(seed))
    R, S = doc.shape
    Q = N * B
    bm = flex_block_mask(doc, pos, anchors, valid, B, sliding_window=window, causal_in_block=causal, tile=tile)
    want = mask_ref(doc, pos, anchors, valid, B, window, causal)
    # what FlexAttention computes: the tiles with the BlockMask's own element-wise rule ...
    assert torch.equal(effective_mask(bm, bm.mask_mod, R, Q, S + Q), want)
    # ... which is the rule itself on every element, not only inside the listed tiles
    assert torch.equal(create_mask(bm.mask_mod, R, 1, Q, S + Q, device="cpu")[:, 0], want)
    mm = make_mask_mod(doc, pos, anchors, valid, B, sliding_window=window, causal_in_block=causal)
    assert torch.equal(effective_mask(bm, mm, R, Q, S + Q), want)


def test_analytic_block_mask_is_sparse_and_uses_full_tiles():
    # one long document with all positions in the loss: anchors far apart, long contexts
    S, B, N = 512, 4, 32
    doc = torch.zeros(1, S, dtype=torch.long)
    pos = torch.arange(S)[None]
    loss = torch.ones(1, S, dtype=torch.bool)
    anchors, valid = select_anchors(loss, doc, N, B, generator=torch.Generator().manual_seed(0))
    bm = flex_block_mask(doc, pos, anchors, valid, B, sliding_window=64, tile=16)
    assert int(bm.full_kv_num_blocks.sum()) > 0
    listed = int(bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum())
    assert listed < 0.5 * bm.kv_num_blocks.shape[2] * -(-(S + N * B) // 16)
