"""The dspark variant's training rule against brute-force loops (docs/dflash-spec.md, "Variant: dspark")."""

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from dflash_train.drafter import head_kernel
from dflash_train.drafter import loss as loss_module
from dflash_train.drafter.checkpoint import load_drafter, save_drafter
from dflash_train.drafter.config import DrafterSpec
from dflash_train.drafter.labels import build_block_labels
from dflash_train.drafter.loss import LossConfig, head_cross_entropy, weighted_head_cross_entropy
from dflash_train.drafter.dspark import markov_drafts, previous_tokens
from dflash_train.drafter.masks import build_layer_masks
from dflash_train.drafter.model import DFlashDrafter, block_input_ids, block_positions
from dflash_train.drafter.step import FrozenHeads, StepConfig, drafter_forward, drafter_step, head_operands
from dflash_train.target.runner import TargetOutput
from dflash_train.utils.errors import ModelError

from .test_model import TAPS, H, V, _batch, packed, tiny_config

R, S, B = 2, 18, 4


def prev_ref(ids, anchors, labels, lv):
    """Slot k's previous token by the rule, one slot at a time."""
    out = torch.full_like(labels, -1)
    for r in range(labels.shape[0]):
        for j in range(labels.shape[1]):
            a = int(anchors[r, j])
            for k in range(1, labels.shape[2]):
                if lv[r, j, k - 1]:
                    out[r, j, k] = labels[r, j, k - 1]
                else:
                    out[r, j, k] = ids[r, min(a + k - 1, ids.shape[1] - 1)]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_previous_tokens_match_brute_force(seed):
    ids, pos, doc, loss, anchors, valid = _batch(seed)
    labels, lv = build_block_labels(ids, doc, loss, anchors, valid, B)
    g = torch.Generator().manual_seed(seed)  # labels that differ from the data, as `target` ones do
    labels = torch.where(lv, torch.randint(0, V, labels.shape, generator=g), labels)
    got = previous_tokens(ids, anchors, labels, lv)
    want = prev_ref(ids, anchors, labels, lv)
    assert torch.equal(got[..., 1:], want[..., 1:])
    assert torch.equal(got[..., 1], torch.gather(ids, 1, anchors))  # slot 1 follows the anchor


def _head_case(g, soft, M=13, H=8, r=3, V=29):
    """A random head problem: hidden [M, H + r] and tail [V, r] (trained), W [V, H], labels, and
    (soft) a target hidden state [M, H]."""
    hidden = torch.randn(M, H + r, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    tail = torch.randn(V, r, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (M,), generator=g)
    target = torch.randn(M, H, generator=g, dtype=torch.float64) if soft else None
    return hidden, w, tail, labels, target


def _full_logits_ce(hidden, w, tail, labels, target):
    """The reference: logits h @ W.T + code @ tail.T of [h ; code], and the CE per row (soft:
    against the softmax of target @ W.T)."""
    logits = hidden[:, : w.shape[1]] @ w.T + hidden[:, w.shape[1] :] @ tail.T
    if target is not None:
        return logits, -(torch.softmax(target @ w.T, -1) * torch.log_softmax(logits, -1)).sum(-1)
    return logits, F.cross_entropy(logits, labels, reduction="none")


@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_head_with_a_trainable_tail_matches_full_logits(chunk, soft):
    """[h ; code] against [W | tail]: CE, argmax and the gradients of hidden and tail, as autograd
    on the full logits h @ W.T + code @ tail.T gives them."""
    g = torch.Generator().manual_seed(chunk)
    hidden, w, tail, labels, target = _head_case(g, soft)
    M = hidden.shape[0]
    up = torch.rand(M, generator=g, dtype=torch.float64)
    ce, pred = head_cross_entropy(hidden, w, None if soft else labels, target, chunk_rows=chunk, tail=tail)
    (ce * up).sum().backward()
    got = hidden.grad.clone(), tail.grad.clone()
    hidden.grad = tail.grad = None
    logits, ref = _full_logits_ce(hidden, w, tail, labels, target)
    (ref * up).sum().backward()
    torch.testing.assert_close(ce.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(pred, logits.argmax(-1))
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], tail.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("also_per_row", [False, True])
@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_weighted_head_trains_a_tail_without_recomputing_logits(chunk, soft, also_per_row, monkeypatch):
    """The weighted sum's gradients (hidden and tail) equal autograd's on the full logits, and the
    backward pass computes no logits when the loss reads the weighted sum alone; when the per-row
    CEs feed the loss too, their part of the tail's gradient is added (chunks computed again)."""
    calls = []
    head_logits = head_kernel._head_logits
    monkeypatch.setattr(head_kernel, "_head_logits", lambda *a: calls.append(1) or head_logits(*a))
    g = torch.Generator().manual_seed(chunk + 10 * soft)
    hidden, w, tail, labels, target = _head_case(g, soft)
    M = hidden.shape[0]
    weights = torch.rand(M, generator=g, dtype=torch.float64) * (torch.arange(M) % 4 != 0)  # some rows weigh 0
    up = torch.rand(M, generator=g, dtype=torch.float64)
    ce, pred, weighted, got_weights = weighted_head_cross_entropy(hidden, w, None if soft else labels, weights,
                                                                  target, chunk_rows=chunk, tail=tail)
    assert torch.equal(got_weights, weights)
    forward_calls = len(calls)
    assert forward_calls == -(-M // chunk)
    (3.0 * weighted + ((ce * up).sum() if also_per_row else 0)).backward()
    assert len(calls) == forward_calls * (2 if also_per_row else 1)
    got = hidden.grad.clone(), tail.grad.clone()
    hidden.grad = tail.grad = None
    logits, ref = _full_logits_ce(hidden, w, tail, labels, target)
    (3.0 * (ref * weights).sum() + ((ref * up).sum() if also_per_row else 0)).backward()
    # the CE statistics are float32 by design (drafter/loss.py): that bounds the agreement
    torch.testing.assert_close(weighted.double(), (ref * weights).sum(), rtol=1e-5, atol=1e-5)
    assert torch.equal(pred, logits.argmax(-1))
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], tail.grad, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("weighting", ["cap", "cap+decay", "dpace"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_confidence_weighted_loss_trains_a_tail_in_one_pass(weighting, chunk, monkeypatch):
    """drafter_loss with a weighting read from the CEs (each block's weights from its slots'
    detached CEs): the loss, the weight sum and the gradients of hidden and tail equal autograd's
    on the full logits with those weights, and the backward pass computes no logits. Chunks that
    split a block would weigh its slots from a part of the block: chunk_rows is rounded down to
    whole blocks (1 -> 3, 7 -> 6 rows here)."""
    calls = []
    head_logits = head_kernel._head_logits
    monkeypatch.setattr(head_kernel, "_head_logits", lambda *a: calls.append(1) or head_logits(*a))
    g = torch.Generator().manual_seed(chunk)
    Rb, N, Bb, Hh, r, Vv = 2, 5, 4, 6, 3, 13
    w = torch.randn(Vv, Hh, generator=g, dtype=torch.float64)
    tail = torch.randn(Vv, r, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, Vv, (Rb, N, Bb), generator=g)
    lv = torch.rand(Rb, N, Bb, generator=g) > 0.2
    hidden = torch.randn(Rb, N * Bb, Hh + r, generator=g, dtype=torch.float64)
    with torch.no_grad():  # some slots right with a high probability, so the weights spread
        for j in range(N):
            hidden[0, j * Bb + 1, :Hh] = 3 * w[labels[0, j, 1]]
    hidden.requires_grad_(True)
    cfg = LossConfig(weighting=weighting, chunk_rows=chunk, cap_eps=1e-3)
    stats = loss_module.drafter_loss(hidden, w, labels, lv, cfg, tail=tail)
    M = Rb * N * (Bb - 1)
    rows = max(Bb - 1, chunk // (Bb - 1) * (Bb - 1))
    assert len(calls) == -(-M // rows)
    (2.0 * stats.loss_sum).backward()
    assert len(calls) == -(-M // rows)  # none in the backward pass
    got = hidden.grad.clone(), tail.grad.clone()
    hidden.grad = tail.grad = None
    flat = hidden.view(Rb, N, Bb, -1)[:, :, 1:].reshape(M, -1)
    logits, ce = _full_logits_ce(flat, w, tail, labels[:, :, 1:].reshape(-1), None)
    ce = ce.view(Rb, N, Bb - 1)
    weights = loss_module.slot_weights(cfg, Bb, lv[:, :, 1:], torch.exp(-ce.detach()))
    assert float(weights.std()) > 0.1  # the weights really differ by the CEs
    ref = (weights * ce).sum()
    (2.0 * ref).backward()
    torch.testing.assert_close(stats.loss_sum.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stats.weight_sum.double(), weights.sum().double(), rtol=1e-5, atol=1e-6)
    # the weights are float32, from float32 CEs (drafter/loss.py): that bounds the agreement
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[1], tail.grad, rtol=1e-5, atol=1e-4)


def _dspark_model(seed, head="vanilla"):
    torch.manual_seed(seed)
    model = DFlashDrafter(tiny_config(variant="dspark", markov_rank=5, markov_head_type=head)).double()
    m = model.markov_head
    with torch.no_grad():  # a bias as large as the backbone's logits, so a wrong previous token shows
        m.markov_w1.weight.normal_(0, 1)
        m.markov_w2.weight.normal_(0, 1)
        if m.gate_proj is not None:  # gates spread over (0, 1), so a wrong hidden state or code shows
            m.gate_proj.weight.normal_(0, 1)
            m.gate_proj.bias.normal_(0, 1)
    return model


def code_ref(m, h, prev):
    """One slot's bigram code: markov_w1[prev], gated by sigmoid(gate_proj([h ; code]))."""
    code = m.markov_w1.weight[prev]
    if m.gate_proj is None:
        return code
    return torch.sigmoid(m.gate_proj.weight @ torch.cat([h, code]) + m.gate_proj.bias) * code


def step_ref(model, heads, fwd, ids, gamma):
    """The loss sum, one valid slot at a time: CE of lm_head(h) + w2 @ code(h, prev) against the label."""
    labels, lv = fwd.labels, fwd.label_valid
    prev = prev_ref(ids, fwd.anchors, labels, lv)
    hid = fwd.hidden.view(R, -1, B, H)
    m = model.markov_head
    total = torch.zeros((), dtype=torch.float64)
    for r in range(R):
        for j in range(labels.shape[1]):
            for k in range(1, B):
                if not lv[r, j, k]:
                    continue
                h = hid[r, j, k]
                logits = heads.lm_head_weight @ h + m.markov_w2.weight @ code_ref(m, h, prev[r, j, k])
                ce = torch.logsumexp(logits, 0) - logits[labels[r, j, k]]
                total = total + torch.exp(torch.tensor(-(k - 1) / gamma, dtype=torch.float64)) * ce
    return total


@pytest.mark.parametrize("head", ["vanilla", "gated"])
@pytest.mark.parametrize("label_source,fixed_shape", [("data", False), ("target", False), ("target", True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_dspark_step_loss_and_gradients_match_per_slot_reference(seed, label_source, fixed_shape, head, monkeypatch):
    """fixed_shape: compiled mode's step (fixed-shape anchors, padding blocks, the head's chunk
    math through `compiled_once`, here the identity: compiling on a CPU costs tens of seconds)."""
    wrapped = []
    monkeypatch.setattr(head_kernel, "compiled_once", lambda fn: wrapped.append(fn.__name__) or fn)
    model = _dspark_model(seed, head)
    ids, pos, doc, loss, _, _ = _batch(seed + 10)
    g = torch.Generator().manual_seed(seed)
    heads = FrozenHeads(torch.randn(V, H, generator=g, dtype=torch.float64),
                        torch.randn(V, H, generator=g, dtype=torch.float64))
    batch = dict(input_ids=ids, position_ids=pos, document_ids=doc, loss_mask=loss,
                 taps=torch.randn(R, S, TAPS * H, generator=g, dtype=torch.float64),
                 final_hidden=torch.randn(R, S, H, generator=g, dtype=torch.float64))
    # fixed shape: more anchors than a row has candidates, so some blocks are padding
    step_cfg = StepConfig(num_anchors=16 if fixed_shape else 5, label_source=label_source, fixed_shape=fixed_shape)
    loss_cfg = LossConfig(gamma=3.0)
    stats = drafter_step(model, heads, packed(ids, pos, doc, loss), TargetOutput(batch["taps"], batch["final_hidden"]),
                         step_cfg=step_cfg, loss_cfg=loss_cfg, generator=torch.Generator().manual_seed(7))
    assert bool(wrapped) == fixed_shape
    stats.loss_sum.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    fwd = drafter_forward(model, heads, step_cfg=step_cfg, generator=torch.Generator().manual_seed(7), **batch)
    if fixed_shape:  # a fixed number of blocks, some of them padding (no valid anchor there)
        assert fwd.anchors.shape[1] == 16 and not fwd.valid.all()
    if label_source == "target":  # the teacher-forced tokens are then the target's, not the data's
        data_labels, _ = build_block_labels(ids, doc, loss, fwd.anchors, fwd.valid, B)
        assert (fwd.labels != data_labels)[fwd.label_valid].any()
    want = step_ref(model, heads, fwd, ids, gamma=3.0)
    want.backward()
    # the CE per label is float32 by design (drafter/loss.py): that bounds the agreement
    torch.testing.assert_close(stats.loss_sum.double(), want, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert got["markov_head.markov_w2.weight"].abs().sum() > 0
    assert got["markov_head.markov_w1.weight"].abs().sum() > 0
    if head == "gated":
        assert got["markov_head.gate_proj.weight"].abs().sum() > 0


def test_dflash_variant_has_no_head_and_reads_the_hidden_states_unchanged():
    torch.manual_seed(0)
    a = DFlashDrafter(tiny_config())
    torch.manual_seed(0)
    b = DFlashDrafter(tiny_config(variant="dflash"))
    assert a.markov_head is None and not any("markov" in n for n in a.state_dict())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    ids, pos, doc, loss, _, _ = _batch(0)
    heads = FrozenHeads(torch.randn(V, H), torch.randn(V, H))
    fwd = drafter_forward(a, heads, input_ids=ids, position_ids=pos, document_ids=doc, loss_mask=loss,
                          taps=torch.randn(R, S, TAPS * H), final_hidden=None, step_cfg=StepConfig(num_anchors=4))
    hidden, tail = head_operands(a, fwd, ids)
    assert hidden is fwd.hidden and tail is None


@pytest.mark.parametrize("head", ["vanilla", "gated"])
def test_markov_drafts_are_sequential_greedy(head):
    model = _dspark_model(3, head)
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, B - 1, H, generator=g, dtype=torch.float64)
    lm = torch.randn(V, H, generator=g, dtype=torch.float64)
    anchors = torch.tensor([1, 5, 9])
    m = model.markov_head
    got = markov_drafts(hidden, anchors, lm, *m.weights())
    for s in range(3):
        prev = int(anchors[s])
        for k in range(B - 1):
            logits = lm @ hidden[s, k] + m.markov_w2.weight @ code_ref(m, hidden[s, k], prev)
            prev = int(logits.argmax())
            assert got[s, k] == prev


@pytest.mark.parametrize("kw,match", [(dict(variant="domino"), "variant"), (dict(markov_rank=0), "markov_rank")])
def test_bad_variant_fields_are_rejected(kw, match):
    with pytest.raises(ValueError, match=match):
        tiny_config(**kw)
    with pytest.raises(ValueError, match=match):
        DrafterSpec(**kw)


@pytest.mark.parametrize("head", ["vanilla", "gated"])
def test_export_round_trip_gives_identical_logits_in_the_vllm_layout(tmp_path, head):
    """save -> config.json in vLLM's Qwen3 DSpark layout -> load -> the same block logits, bit for bit."""
    model = _dspark_model(4, head).float()
    out = save_drafter(model, tmp_path / "d", dtype=torch.float32)
    data = json.loads((out / "config.json").read_text())
    assert data["architectures"] == ["DSparkDraftModel"] and data["model_type"] == "qwen3"
    assert (data["markov_rank"], data["markov_head_type"], data["sample_from_anchor"]) == (5, head, False)
    assert data["dflash_config"]["projector_type"] == "dspark" and data["draft_vocab_size"] == V
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("markov_head.markov_w1.weight").shape == (V, 5)
        assert f.get_tensor("markov_head.markov_w2.weight").shape == (V, 5)
        gate_names = {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}
        assert (gate_names <= set(f.keys())) == (head == "gated")
        if head == "gated":
            assert f.get_tensor("markov_head.gate_proj.weight").shape == (5, H + 5)
    loaded = load_drafter(out)
    assert loaded.config == model.config and loaded.config.variant == "dspark"
    ids, pos, doc, loss, anchors, valid = _batch(4)
    emb, lm = torch.randn(V, H), torch.randn(V, H)
    taps = torch.randn(R, S, TAPS * H)
    labels, lv = build_block_labels(ids, doc, loss, anchors, valid, B)
    prev = previous_tokens(ids, anchors, labels, lv).view(R, -1)

    def logits(m):
        masks = build_layer_masks(m.config, doc, pos, anchors, valid, backend="dense")
        h = m(taps, pos, emb[block_input_ids(ids, anchors, B, m.config.mask_token_id)],
              block_positions(pos, anchors, B), masks)
        return m.markov_head.widen(h, prev) @ torch.cat([lm, m.markov_head.markov_w2.weight], dim=1).T

    with torch.no_grad():
        assert torch.equal(logits(model), logits(loaded))


def test_a_dspark_checkpoint_that_drafts_from_the_anchor_is_refused(tmp_path):
    out = save_drafter(_dspark_model(0), tmp_path / "d")
    data = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**data, "sample_from_anchor": True}))
    with pytest.raises(ModelError, match="sample_from_anchor"):
        load_drafter(out)
