"""PackedBatch and pack_documents against a brute-force, token-at-a-time builder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_train.data.batch import PackedBatch, pack_documents


def brute_force(docs, rows, S=None, R=None):
    """Token at a time, straight from the contract in docs/architecture.md."""
    S = S or max(sum(len(docs[i][1]) for i in row) for row in rows)
    R = R or len(rows)
    ids = [[0] * S for _ in range(R)]
    pos = [[0] * S for _ in range(R)]
    doc = [[-1] * S for _ in range(R)]
    loss = [[False] * S for _ in range(R)]
    sample_ids = []
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            sid, toks, mask = docs[i]
            d = len(sample_ids)
            sample_ids.append(sid)
            for k in range(len(toks)):
                ids[r][col], pos[r][col], doc[r][col], loss[r][col] = int(toks[k]), k, d, bool(mask[k])
                col += 1
    return ids, pos, doc, loss, sample_ids


def random_docs(rng, n):
    docs = []
    for _ in range(n):
        length = int(rng.integers(1, 20))
        docs.append((int(rng.integers(0, 10_000)), rng.integers(1, 50_000, length).astype(np.int32),
                     rng.random(length) < 0.6))
    return docs


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed):
    rng = np.random.default_rng(seed)
    docs = random_docs(rng, int(rng.integers(1, 12)))
    order = rng.permutation(len(docs)).tolist()
    cuts = sorted(rng.choice(np.arange(1, len(docs)), size=min(len(docs) - 1, int(rng.integers(0, 4))), replace=False).tolist()) if len(docs) > 1 else []
    rows = [order[a:b] for a, b in zip([0] + cuts, cuts + [len(docs)])]
    batch = pack_documents(docs, rows, epoch=3, index=7)
    batch.validate()
    ids, pos, doc, loss, sample_ids = brute_force(docs, rows)
    assert batch.input_ids.tolist() == ids
    assert batch.position_ids.tolist() == pos
    assert batch.document_ids.tolist() == doc
    assert batch.loss_mask.tolist() == loss
    assert batch.sample_ids.tolist() == sample_ids
    assert (batch.epoch, batch.index) == (3, 7)
    assert batch.num_tokens == sum(len(d[1]) for d in docs)
    assert batch.input_ids.dtype == torch.int64 and batch.loss_mask.dtype == torch.bool


def test_default_one_document_per_row_and_fixed_shape():
    docs = [(5, [1, 2, 3], [0, 1, 1]), (9, [4], [1])]
    batch = pack_documents(docs, row_length=6, num_rows=3)
    assert batch.shape == (3, 6)
    ids, pos, doc, loss, sids = brute_force(docs, [[0], [1]], S=6, R=3)
    assert batch.input_ids.tolist() == ids and batch.document_ids.tolist() == doc
    assert batch.position_ids.tolist() == pos and batch.loss_mask.tolist() == loss and batch.sample_ids.tolist() == sids


def test_pad_to():
    docs = [(0, [7, 8, 9], [0, 1, 1]), (1, [5, 6], [1, 1])]
    batch = pack_documents(docs, [[0, 1]])
    padded = batch.pad_to(2, 8)
    assert padded.shape == (2, 8)
    ids, pos, doc, loss, _ = brute_force(docs, [[0, 1]], S=8, R=2)
    assert padded.input_ids.tolist() == ids and padded.position_ids.tolist() == pos
    assert padded.document_ids.tolist() == doc and padded.loss_mask.tolist() == loss
    assert padded.num_tokens == batch.num_tokens == 5
    padded.validate()
    assert batch.pad_to(1, 5) is batch
    with pytest.raises(ValueError, match="drop tokens"):
        batch.pad_to(1, 4)
    with pytest.raises(ValueError, match="drop tokens"):
        padded.pad_to(1, 8)


def test_to_and_pin():
    batch = pack_documents([(0, [1, 2], [0, 1])])
    moved = batch.to("cpu")
    assert isinstance(moved, PackedBatch) and torch.equal(moved.input_ids, batch.input_ids)
    if torch.cuda.is_available():  # pinning needs an accelerator
        assert batch.pin_memory().input_ids.is_pinned()


def test_bad_input():
    with pytest.raises(ValueError, match="exactly once"):
        pack_documents([(0, [1], [1]), (1, [2], [1])], [[0, 0]])
    with pytest.raises(ValueError, match="lengths differ"):
        pack_documents([(0, [1, 2], [1])])
    with pytest.raises(ValueError, match="do not fit"):
        pack_documents([(0, [1, 2], [1, 1])], row_length=1)
