import math
import random
import re
import weakref

import pytest
import torch
import torch.nn.functional as F

from dflash_train.drafter.anchors import select_anchors
from dflash_train.drafter.labels import IGNORE, build_block_labels
from dflash_train.drafter import head_kernel
from dflash_train.drafter.head_kernel import (_hard_label_chunk, _softmax_minus_onehot, _softmax_minus_onehot_eager,
                                              _softmax_minus_onehot_into_logits, group_aligned_chunk,
                                              weighted_head_cross_entropy)
from dflash_train.drafter.loss import LossConfig, default_gamma, drafter_loss, head_cross_entropy, slot_weights, summarize
from dflash_train.drafter.row_stats import row_stats

from .reference import cap_ref, decay_ref, dpace_ref, random_packed_layout, tau_ref


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_head_cross_entropy_matches_full_logits(chunk):
    g = torch.Generator().manual_seed(0)
    M, H, V = 13, 8, 29
    hidden = torch.randn(M, H, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (M,), generator=g)
    upstream = torch.rand(M, generator=g, dtype=torch.float64)
    ce, pred = head_cross_entropy(hidden, w, labels, chunk_rows=chunk)
    (ce * upstream).sum().backward()
    got_grad = hidden.grad.clone()
    hidden.grad = None
    logits = hidden @ w.T
    ref = F.cross_entropy(logits, labels, reduction="none")
    (ref * upstream).sum().backward()
    torch.testing.assert_close(ce.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(pred, logits.argmax(-1))
    torch.testing.assert_close(got_grad, hidden.grad, rtol=1e-6, atol=1e-6)



@pytest.mark.parametrize("chunk_rows,group_rows,expected", [
    (4096, 15, 4080),  # whole blocks of 15 slots and a multiple of 16: not 4095
    (4096, 1, 4096), (100, 1, 96), (5, 1, 5),
    (64, 15, 60),  # below lcm(15, 16) = 240: whole groups only
    (7, 15, 15),  # at least one group
    (480, 15, 480), (479, 15, 240),
])
def test_group_aligned_chunk(chunk_rows, group_rows, expected):
    got = group_aligned_chunk(chunk_rows, group_rows)
    assert got == expected
    assert got % group_rows == 0 and (got <= chunk_rows or got == group_rows)


@pytest.mark.parametrize("weigher", [False, True])
def test_chunks_follow_blocks_only_for_a_weigher(weigher, monkeypatch):
    """Fixed row weights leave the chunks as asked (their matmuls stay aligned); a weigher, which
    reads its chunk's CEs a block at a time, gets whole blocks; the sum is the same either way."""
    rows = []
    head_logits = head_kernel._head_logits
    monkeypatch.setattr(head_kernel, "_head_logits", lambda h, *a: rows.append(h.shape[0]) or head_logits(h, *a))
    g = torch.Generator().manual_seed(3)
    M, H, V, group = 150, 8, 29, 15
    hidden = torch.randn(M, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (M,), generator=g)
    weights = torch.rand(M, generator=g, dtype=torch.float64)
    row_weights = (lambda ce, sl: weights[sl]) if weigher else weights
    ce, _, weighted, _ = weighted_head_cross_entropy(hidden, w, labels, row_weights, chunk_rows=64, group_rows=group)
    assert rows == ([60, 60, 30] if weigher else [64, 64, 22])
    ref = F.cross_entropy(hidden @ w.T, labels, reduction="none")
    torch.testing.assert_close(weighted.double(), (ref * weights).sum(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tail", [False, True])
def test_a_chunk_frees_its_logits_before_the_next_chunk_is_made(tail, monkeypatch):
    """The [c, V] logits and gradient of a chunk are gone when the next chunk's logits are made
    (forward loop and, with a trainable tail read per row, the backward's second pass): the head's
    peak is one chunk's pair, not two."""
    alive, seen = [], []  # weak references to every chunk's [c, V] tensors; earlier ones alive at each new chunk
    head_logits, chunk_ce = head_kernel._head_logits, head_kernel._chunk_ce

    def logits_fn(*args):
        seen.append(sum(ref() is not None for ref in alive))
        out = head_logits(*args)
        alive.append(weakref.ref(out))
        return out

    def chunk_ce_fn(*args):
        ce, pred, grad = chunk_ce(*args)
        if grad is not None:
            alive.append(weakref.ref(grad))
        return ce, pred, grad

    monkeypatch.setattr(head_kernel, "_head_logits", logits_fn)
    monkeypatch.setattr(head_kernel, "_chunk_ce", chunk_ce_fn)
    g = torch.Generator().manual_seed(5)
    M, H, V, r = 40, 8, 29, 3
    hidden = torch.randn(M, H + (r if tail else 0), generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    tail_w = torch.randn(V, r, generator=g, dtype=torch.float64, requires_grad=True) if tail else None
    labels = torch.randint(0, V, (M,), generator=g)
    ce, _, weighted, _ = weighted_head_cross_entropy(hidden, w, labels, torch.rand(M, generator=g, dtype=torch.float64),
                                                     chunk_rows=16, tail=tail_w)
    (weighted + ce.sum()).backward()  # the per-row CEs too: a tail's gradient is then computed chunk by chunk again
    assert len(seen) == 3 * (2 if tail else 1)
    assert seen == [0] * len(seen)

@pytest.mark.parametrize("scale", [1e2, 1e4])
def test_head_cross_entropy_with_large_logits(scale):
    """Logits of +-1e4 and more: the max-shifted log-sum-exp neither overflows nor loses the label."""
    g = torch.Generator().manual_seed(2)
    M, H, V = 11, 8, 31
    hidden = (torch.randn(M, H, generator=g, dtype=torch.float64) * scale).requires_grad_()
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (M,), generator=g)
    ce, pred = head_cross_entropy(hidden, w, labels, chunk_rows=4)
    ref = F.cross_entropy(hidden.detach() @ w.T, labels, reduction="none")
    assert bool(torch.isfinite(ce).all())
    torch.testing.assert_close(ce.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(pred, (hidden.detach() @ w.T).argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hard_label_chunk_gradient_is_softmax_minus_one_hot_bit_for_bit(dtype):
    """The per-chunk gradient: exp(logit - lse), 1 taken off at the label, element by element."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(9, 41, generator=g) * 4).to(dtype)
    labels = torch.randint(0, 41, (9,), generator=g)
    ce, pred, grad = _hard_label_chunk(logits, labels, need_grad=True)
    lf = logits.float()
    lse, label_logit, _ = row_stats(logits, labels)
    want = torch.exp(lf - lse[:, None])
    for i, label in enumerate(labels.tolist()):
        want[i, label] = want[i, label] - 1.0
    assert grad.dtype == dtype and torch.equal(grad, want.to(dtype))
    assert torch.equal(ce, lse - lf[torch.arange(9), labels]) and torch.equal(pred, lf.argmax(-1))
    torch.testing.assert_close(lse, torch.logsumexp(lf, -1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_eager_gradient_equals_the_one_hot_form_bit_for_bit(dtype):
    """Eager mode's three-pass gradient against the one-hot form compiled mode runs (here
    uncompiled), labels outside the vocabulary included (IGNORE rows take nothing off)."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(12, 53, generator=g) * 5).to(dtype)
    labels = torch.randint(0, 53, (12,), generator=g)
    labels[[2, 7]] = IGNORE
    labels[9] = 53  # one past the vocabulary
    lse = torch.logsumexp(logits.float(), -1)
    got = _softmax_minus_onehot_eager(logits, lse, labels)
    want = _softmax_minus_onehot(logits, lse, labels)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    assert torch.equal(got[2], torch.exp(logits[2].float() - lse[2]).to(dtype))  # an ignored row: no 1 taken off


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_modes_gradient_is_written_over_the_logits(dtype):
    """What compiled mode runs: the one-hot form's numbers bit for bit, stored in the logits' own
    buffer (no second [c, V] tensor)."""
    g = torch.Generator().manual_seed(6)
    logits = (torch.randn(12, 53, generator=g) * 5).to(dtype)
    labels = torch.randint(0, 53, (12,), generator=g)
    labels[3] = IGNORE
    lse = torch.logsumexp(logits.float(), -1)
    want = _softmax_minus_onehot(logits, lse, labels)
    got = _softmax_minus_onehot_into_logits(logits, lse, labels)
    assert got.data_ptr() == logits.data_ptr() and torch.equal(got, want)


def test_head_cross_entropy_soft_targets():
    g = torch.Generator().manual_seed(1)
    M, H, V = 9, 6, 17
    hidden = torch.randn(M, H, generator=g, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(M, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    ce, _ = head_cross_entropy(hidden, w, None, teacher, chunk_rows=4)
    ce.sum().backward()
    got = hidden.grad.clone()
    hidden.grad = None
    ref = -(torch.softmax(teacher @ w.T, -1) * torch.log_softmax(hidden @ w.T, -1)).sum(-1)
    ref.sum().backward()
    # logits are evaluated in float32 by design
    torch.testing.assert_close(ce.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, hidden.grad, rtol=1e-5, atol=1e-5)


def test_decay_weights_and_default_gamma():
    assert [default_gamma(b) for b in (16, 10, 8)] == [7, 5, 4]
    lv = torch.ones(1, 1, 15, dtype=torch.bool)
    lv[0, 0, 3] = False
    w = slot_weights(LossConfig(weighting="decay"), 16, lv, None)[0, 0].tolist()
    want = decay_ref(16, 7)
    want[3] = 0.0
    assert w == pytest.approx(want)


def test_cap_weights_match_loop_and_autograd_derivative():
    g = torch.Generator().manual_seed(2)
    B = 8
    p = torch.rand(3, 4, B - 1, generator=g, dtype=torch.float64) * 0.9 + 0.1
    lv = torch.rand(3, 4, B - 1, generator=g) > 0.2
    cfg = LossConfig(weighting="cap", cap_alpha=0.5, cap_eps=1e-3)
    w = slot_weights(cfg, B, lv, p)
    for r in range(3):
        for j in range(4):
            c = [float(p[r, j, k]) if lv[r, j, k] else None for k in range(B - 1)]
            want = [wk if lv[r, j, k] else 0.0 for k, wk in enumerate(cap_ref(c, 0.5, 1e-3))]
            assert w[r, j].tolist() == pytest.approx(want)
    # independent check: w_k = dE/dlog c_k with E = sum_m prod_{i<=m} c_i (all slots valid)
    logc = (0.5 * torch.log(p[0, 0])).clone().requires_grad_(True)
    E = torch.cumprod(torch.exp(logc), 0).sum()
    E.backward()
    w_all = slot_weights(cfg, B, torch.ones(1, 1, B - 1, dtype=torch.bool), p[0:1, 0:1])[0, 0]
    torch.testing.assert_close(w_all.double(), logc.grad.clamp(min=1e-3), rtol=1e-5, atol=1e-6)
    # cap+decay is the product
    both = slot_weights(LossConfig(weighting="cap+decay", cap_alpha=0.5, cap_eps=1e-3), B, lv, p)
    decay = torch.tensor([math.exp(-(k - 1) / 4) for k in range(1, B)])
    torch.testing.assert_close(both.double(), (w * decay).double(), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("alpha", [0.5, 0.3, 1.0])
def test_dpace_weights_match_loop(alpha):
    g = torch.Generator().manual_seed(4)
    B = 8
    p = torch.rand(3, 4, B - 1, generator=g, dtype=torch.float64)
    lv = torch.rand(3, 4, B - 1, generator=g) > 0.25
    lv[0, 0] = True  # one block with every slot valid, one with none
    lv[0, 1] = False
    w = slot_weights(LossConfig(weighting="dpace", dpace_alpha=alpha), B, lv, p)
    for r in range(3):
        for j in range(4):
            c = [float(p[r, j, k]) if lv[r, j, k] else None for k in range(B - 1)]
            want = [wk if lv[r, j, k] else 0.0 for k, wk in enumerate(dpace_ref(c, alpha))]
            assert w[r, j].tolist() == pytest.approx(want, rel=1e-6)
    assert w[0, 1].abs().sum() == 0
    # alpha = 1: every confidence is 1, so w_k counts the valid slots from k on (uniform in spirit)
    if alpha == 1.0:
        assert w[0, 0].tolist() == pytest.approx([float(B - 1 - k) for k in range(B - 1)])
    # an invalid slot in the middle is skipped, not a stop (cap stops there: it cannot be accepted)
    mid = torch.ones(1, 1, B - 1, dtype=torch.bool)
    mid[0, 0, 2] = False
    w_mid = slot_weights(LossConfig(weighting="dpace", dpace_alpha=alpha), B, mid, p[0:1, 0:1])[0, 0]
    assert w_mid[2] == 0 and w_mid[3] > 0


def test_dpace_needs_hard_labels_and_a_valid_alpha():
    with pytest.raises(ValueError, match="dpace_alpha"):
        LossConfig(weighting="dpace", dpace_alpha=0.0)
    with pytest.raises(ValueError, match="needs the drafter's probabilities"):
        slot_weights(LossConfig(weighting="dpace"), 4, torch.ones(1, 1, 3, dtype=torch.bool), None)


@pytest.mark.parametrize("weighting", ["decay", "cap", "cap+decay", "dpace"])
def test_drafter_loss_metrics_against_brute_force(weighting):
    rng = random.Random(5)
    ids, _, doc, loss = random_packed_layout(rng, 2, 40)
    ids = ids % 11
    B, H, V, N = 4, 6, 11, 8
    anchors, valid = select_anchors(loss, doc, N, B, generator=torch.Generator().manual_seed(0))
    labels, lv = build_block_labels(ids, doc, loss, anchors, valid, B)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, N * B, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    # make some predictions right so that tau > 1 is exercised
    for r in range(2):
        for j in range(N):
            for k in range(1, 3):
                if lv[r, j, k]:
                    hidden[r, j * B + k] = 4 * w[labels[r, j, k]]
    cfg = LossConfig(weighting=weighting, cap_eps=1e-3)
    stats = drafter_loss(hidden, w, labels, lv, cfg)
    logits = (hidden @ w.T).view(2, N, B, V)
    pred = logits.argmax(-1)
    ce = F.cross_entropy(logits.reshape(-1, V), labels.clamp(min=0).reshape(-1), reduction="none").view(2, N, B)
    p_correct = torch.exp(-ce[:, :, 1:])
    wts = slot_weights(cfg, B, lv[:, :, 1:], p_correct)
    m = summarize(stats)
    assert m["loss"] == pytest.approx(float((wts * ce[:, :, 1:]).sum() / wts.sum()), rel=1e-6)
    assert m["ce"] == pytest.approx(float(ce[lv].mean()), rel=1e-6)
    tau_total, blocks = tau_ref(pred, labels, lv)
    assert m["tau"] == pytest.approx(tau_total / blocks)
    assert m["tau"] > 1.5
    for k in range(1, B):
        sel = lv[:, :, k]
        assert m[f"acc_{k}"] == pytest.approx(float((pred[:, :, k][sel] == labels[:, :, k][sel]).double().mean()))
    # reach_k, block by block: the leading run of right slots is at least k long
    runs = []
    for r in range(2):
        for j in range(N):
            if not lv[r, j, 1:].any():
                continue
            run = 0
            while run + 1 < B and lv[r, j, run + 1] and pred[r, j, run + 1] == labels[r, j, run + 1]:
                run += 1
            runs.append(run)
    for k in range(1, B):
        assert m[f"reach_{k}"] == pytest.approx(sum(run >= k for run in runs) / len(runs))
    assert 1 + sum(m[f"reach_{k}"] for k in range(1, B)) == pytest.approx(m["tau"])
    assert m[f"reach_{B - 1}"] < m["reach_2"] < m["reach_1"]  # the runs differ in length: every count matters


def test_normalisation_is_by_global_weight_sum():
    """Two uneven micro-batches: the summarised loss is sum(w*ce) / sum(w) over both."""
    g = torch.Generator().manual_seed(9)
    B, H, V = 4, 5, 7
    parts = []
    for n in (1, 6):
        hidden = torch.randn(1, n * B, H, generator=g)
        labels = torch.randint(0, V, (1, n, B), generator=g)
        lv = torch.ones(1, n, B, dtype=torch.bool)
        lv[..., 0] = False
        parts.append(drafter_loss(hidden, torch.randn(V, H, generator=g), labels, lv, LossConfig()))
    combined = summarize(parts)["loss"]
    num = sum(float(p.loss_sum) for p in parts)
    den = sum(float(p.weight_sum) for p in parts)
    assert combined == pytest.approx(num / den)
    mean_of_means = sum(float(p.loss_sum / p.weight_sum) for p in parts) / 2
    assert combined != pytest.approx(mean_of_means)


def test_loss_config_validation():
    with pytest.raises(ValueError, match="weighting"):
        LossConfig(weighting="nope")
    with pytest.raises(ValueError, match="cap_alpha"):
        LossConfig(cap_alpha=0)


@pytest.mark.parametrize("weighting", ["cap", "cap+decay", "dpace"])
def test_confidence_weightings_refuse_soft_labels(weighting):
    from dflash_train.train.config import TrainConfig
    from dflash_train.utils.config import load_config
    from dflash_train.utils.errors import ConfigError

    with pytest.raises(ConfigError, match=f"'{re.escape(weighting)}' needs hard labels"):
        load_config(TrainConfig, None, {"data.path": "d", "step.label_source": "distill", "loss.weighting": weighting})
    assert load_config(TrainConfig, None, {"data.path": "d", "step.label_source": "distill",
                                           "loss.weighting": "decay"}).loss.weighting == "decay"
