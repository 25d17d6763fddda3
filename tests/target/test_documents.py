"""The gather maps between packed rows and their documents' [D, L] batch (target/documents.py),
against a token-by-token walk of the packed rows."""

import random

import pytest
import torch

from dflash_train.data.batch import pack_documents
from dflash_train.target.documents import round_up, unpack_documents


def test_round_up_adds_at_most_an_eighth_and_keeps_eight_sizes_per_octave():
    assert [round_up(n) for n in range(1, 17)] == list(range(1, 17))
    assert [round_up(n) for n in (17, 18, 31, 33, 100, 1000, 8000, 8192)] == [18, 18, 32, 36, 104, 1024, 8192, 8192]
    for n in range(1, 20000):
        assert n <= round_up(n) <= n + n / 8
    for k in range(4, 14):
        assert len({round_up(n) for n in range(2 ** k + 1, 2 ** (k + 1) + 1)}) == 8


def _random_batch(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 25))]
    order = list(range(len(lengths)))
    rng.shuffle(order)
    rows, i = [], 0
    while i < len(order):  # rows of 1-4 documents, in a shuffled order
        k = rng.randint(1, 4)
        rows.append(order[i:i + k])
        i += k
    docs = [(i, torch.arange(n) + 1000 * i, torch.ones(n, dtype=torch.bool)) for i, n in enumerate(lengths)]
    return pack_documents(docs, rows, num_rows=len(rows) + rng.randint(0, 1))


@pytest.mark.parametrize("round_shape", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_the_maps_put_every_token_at_its_document_and_position_and_back(seed, round_shape):
    batch = _random_batch(seed)
    ids, pos = batch.document_ids, batch.position_ids
    R, S = ids.shape
    walk = {}  # (document, position) -> (row, column), by walking the packed rows
    for r in range(R):
        for s in range(S):
            if ids[r, s] >= 0:
                walk[int(ids[r, s]), int(pos[r, s])] = (r, s)
    D, L = max(d for d, _ in walk) + 1, max(p for _, p in walk) + 1
    lay = unpack_documents(ids, pos, round_shape=round_shape)
    assert (lay.D, lay.L) == ((round_up(D), round_up(L)) if round_shape else (D, L))
    values = torch.randn(R, S, 3)
    docs = lay.docs(values)
    assert docs.shape == (lay.D, lay.L, 3)
    for (d, p), (r, s) in walk.items():
        assert torch.equal(docs[d, p], values[r, s])
    assert lay.lengths.tolist() == [sum(1 for dd, _ in walk if dd == d) for d in range(lay.D)]
    # every slot, real or not, reads a real token (so nothing unset or stale enters attention)
    assert (ids.reshape(-1)[lay.to_docs] >= 0).all()
    back = lay.packed(docs)
    real = ids >= 0
    assert back.shape == values.shape and torch.equal(back[real], values[real])


def test_a_batch_without_tokens_has_no_documents():
    ids = torch.full((2, 5), -1)
    lay = unpack_documents(ids, torch.zeros(2, 5, dtype=torch.long), round_shape=True)
    assert (lay.D, lay.L) == (0, 0) and lay.docs(torch.ones(2, 5, 4)).shape == (0, 0, 4)
