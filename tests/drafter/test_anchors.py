import random

import pytest
import torch

from dflash_train.drafter.anchors import anchor_candidates, select_anchors, trim_anchor_columns

from .reference import candidates_ref, random_packed_layout


@pytest.mark.parametrize("seed", range(10))
def test_candidates_match_brute_force(seed):
    _, _, doc, loss = random_packed_layout(random.Random(seed), 3, 50)
    cand = anchor_candidates(loss, doc)
    want = candidates_ref(loss, doc)
    for r in range(3):
        assert torch.nonzero(cand[r]).flatten().tolist() == want[r]


@pytest.mark.parametrize("fixed_shape", [False, True])
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("n", [1, 5, 40, 200])
def test_anchor_invariants(fixed_shape, seed, n):
    _, _, doc, loss = random_packed_layout(random.Random(seed), 3, 60)
    g = torch.Generator().manual_seed(seed)
    anchors, valid = select_anchors(loss, doc, n, 16, generator=g, fixed_shape=fixed_shape)
    assert anchors.shape == (3, n) and valid.shape == (3, n)
    assert anchors.dtype == torch.long and valid.dtype == torch.bool
    for r, cands in enumerate(candidates_ref(loss, doc)):
        chosen = anchors[r][valid[r]].tolist()
        assert len(chosen) == min(n, len(cands))  # count = min(N, candidates)
        assert set(chosen) <= set(cands)  # only candidates
        assert len(set(chosen)) == len(chosen)  # distinct
        assert chosen == sorted(chosen)  # sorted
        assert valid[r].tolist() == [True] * len(chosen) + [False] * (n - len(chosen))  # valid first
        assert anchors[r].tolist() == sorted(anchors[r].tolist())  # whole row sorted, in bounds
        assert int(anchors[r].max()) < 60


def _inclusion_counts(fixed_shape, draws=3000, n=4):
    # one row, two documents, 20 candidates in all
    doc = torch.tensor([[0] * 14 + [1] * 12 + [-1] * 4])
    loss = torch.ones_like(doc, dtype=torch.bool)
    loss[0, 3] = False  # position 2 is not a candidate
    cands = candidates_ref(loss, doc)[0]
    g = torch.Generator().manual_seed(1234 + fixed_shape)
    counts = torch.zeros(doc.shape[1])
    for _ in range(draws):
        a, v = select_anchors(loss, doc, n, 8, generator=g, fixed_shape=fixed_shape)
        counts[a[0][v[0]]] += 1
    return counts, cands, draws * n / len(cands)


def _chi2(observed, expected):
    return float(((observed - expected) ** 2 / expected).sum())


def _chi2_quantile_999(dof):
    """Wilson-Hilferty approximation of the 99.9% chi-square quantile."""
    z = 3.0902
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.mark.parametrize("fixed_shape", [False, True])
def test_anchor_selection_is_uniform(fixed_shape):
    counts, cands, expected = _inclusion_counts(fixed_shape)
    assert counts[[p for p in range(len(counts)) if p not in cands]].sum() == 0
    assert len(cands) == 23
    assert _chi2(counts[cands], torch.full((len(cands),), expected)) < _chi2_quantile_999(len(cands) - 1)


def test_both_paths_have_the_same_distribution():
    dyn, cands, _ = _inclusion_counts(False)
    fix, _, _ = _inclusion_counts(True)
    # two-sample chi-square on inclusion counts (equal totals)
    a, b = dyn[cands], fix[cands]
    stat = float(((a - b) ** 2 / (a + b)).sum())
    assert stat < _chi2_quantile_999(len(cands) - 1)


def test_anchors_redrawn_each_call_and_reproducible_by_seed():
    _, _, doc, loss = random_packed_layout(random.Random(7), 1, 80)
    g = torch.Generator().manual_seed(0)
    first, _ = select_anchors(loss, doc, 5, 4, generator=g)
    second, _ = select_anchors(loss, doc, 5, 4, generator=g)
    assert not torch.equal(first, second)
    again, _ = select_anchors(loss, doc, 5, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(first, again)


def test_trim_drops_only_all_invalid_columns():
    anchors = torch.tensor([[1, 4, 9, 9], [2, 9, 9, 9]])
    valid = torch.tensor([[True, True, False, False], [True, False, False, False]])
    a, v = trim_anchor_columns(anchors, valid)
    assert a.tolist() == [[1, 4], [2, 9]] and v.tolist() == [[True, True], [True, False]]


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_anchors"):
        select_anchors(torch.ones(1, 4), torch.zeros(1, 4, dtype=torch.long), 0, 4)
    with pytest.raises(ValueError, match=r"\[R, S\]"):
        select_anchors(torch.ones(4), torch.zeros(4, dtype=torch.long), 2, 4)
