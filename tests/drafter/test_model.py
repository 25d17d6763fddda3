import math
import random

import pytest
import torch

from dflash_train.drafter.anchors import select_anchors
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter import head_kernel
from dflash_train.drafter.labels import target_block_labels
from dflash_train.drafter.loss import LossConfig
from dflash_train.drafter.masks import build_layer_masks
from dflash_train.drafter.model import DFlashDrafter, block_input_ids, block_positions, rope_inverse_frequencies
from dflash_train.data.batch import PackedBatch
from dflash_train.drafter.step import FrozenHeads, StepConfig, drafter_forward, drafter_step
from dflash_train.target.runner import TargetOutput

from .reference import mask_ref, random_packed_layout

H, V, TAPS = 16, 23, 3


def tiny_config(**kw):
    base = dict(
        hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=24,
        vocab_size=V, target_layer_ids=[0, 2, 3], num_target_layers=5, mask_token_id=V - 1,
        num_hidden_layers=2, block_size=4, layer_types=["sliding_attention", "full_attention"], sliding_window=6,
        rope_theta=100.0,
    )
    base.update(kw)
    return DrafterConfig(**base)


def _rms(x, w, eps):
    return w * x / math.sqrt(sum(float(v) ** 2 for v in x) / len(x) + eps)


def _rope(vec, position, inv_freq):
    """Rotate pairs (i, i + d/2) by angle position * inv_freq[i]."""
    d = len(vec)
    out = vec.clone()
    for i in range(d // 2):
        ang = position * float(inv_freq[i])
        c, s = math.cos(ang), math.sin(ang)
        out[i] = vec[i] * c - vec[i + d // 2] * s
        out[i + d // 2] = vec[i + d // 2] * c + vec[i] * s
    return out


def reference_forward(model, ctx_raw, pos, block_emb, block_pos, layer_masks):
    """The spec's drafter, one query at a time, in float64."""
    cfg = model.config
    eps = cfg.rms_norm_eps
    sd = {k: v.double() for k, v in model.state_dict().items()}
    inv = rope_inverse_frequencies(cfg)[0].double()
    R, S, _ = ctx_raw.shape
    Q = block_emb.shape[1]
    h, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    out = torch.zeros(R, Q, H, dtype=torch.float64)
    for r in range(R):
        ctx = [_rms(sd["fc.weight"] @ ctx_raw[r, s].double(), sd["hidden_norm.weight"], eps) for s in range(S)]
        x = [block_emb[r, q].double() for q in range(Q)]
        for li in range(cfg.num_hidden_layers):
            p = f"layers.{li}."
            normed = [_rms(v, sd[p + "input_layernorm.weight"], eps) for v in x]

            def kv(src, position):
                k = (sd[p + "self_attn.k_proj.weight"] @ src).view(g, d)
                v = (sd[p + "self_attn.v_proj.weight"] @ src).view(g, d)
                k = torch.stack([_rope(_rms(k[i], sd[p + "self_attn.k_norm.weight"], eps), position, inv) for i in range(g)])
                return k, v

            keys = [kv(ctx[s], int(pos[r, s])) for s in range(S)] + [kv(normed[q], int(block_pos[r, q])) for q in range(Q)]
            new_x = []
            for q in range(Q):
                qv = (sd[p + "self_attn.q_proj.weight"] @ normed[q]).view(h, d)
                heads_out = []
                for hh in range(h):
                    qh = _rope(_rms(qv[hh], sd[p + "self_attn.q_norm.weight"], eps), int(block_pos[r, q]), inv)
                    allowed = [kk for kk in range(S + Q) if layer_masks[li][r, q, kk]]
                    scores = torch.tensor([float(qh @ keys[kk][0][hh // (h // g)]) / math.sqrt(d) for kk in allowed])
                    probs = torch.softmax(scores.double(), 0)
                    heads_out.append(sum(pr * keys[kk][1][hh // (h // g)] for pr, kk in zip(probs, allowed)))
                attn = sd[p + "self_attn.o_proj.weight"] @ torch.cat(heads_out)
                y = x[q] + attn
                z = _rms(y, sd[p + "post_attention_layernorm.weight"], eps)
                gate = sd[p + "mlp.gate_proj.weight"] @ z
                up = sd[p + "mlp.up_proj.weight"] @ z
                new_x.append(y + sd[p + "mlp.down_proj.weight"] @ (torch.nn.functional.silu(gate) * up))
            x = new_x
        for q in range(Q):
            out[r, q] = _rms(x[q], sd["norm.weight"], eps)
    return out


def _batch(seed, R=2, S=18, N=4):
    ids, pos, doc, loss = random_packed_layout(random.Random(seed), R, S, max_docs=3)
    ids = ids % (V - 1)
    anchors, valid = select_anchors(loss, doc, N, 4, generator=torch.Generator().manual_seed(seed))
    return ids, pos, doc, loss, anchors, valid


def packed(input_ids, position_ids, document_ids, loss_mask) -> PackedBatch:
    """Rows as a step takes them (the step reads no sample ids)."""
    return PackedBatch(input_ids, position_ids, document_ids, loss_mask, sample_ids=torch.zeros(0, dtype=torch.long))


@pytest.mark.parametrize("mask_slots", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_drafter_forward_matches_per_query_reference(seed, mask_slots):
    torch.manual_seed(seed)
    cfg = tiny_config()
    model = DFlashDrafter(cfg).double()
    with torch.no_grad():  # non-trivial norm weights so that each norm is exercised
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ids, pos, doc, loss, anchors, valid = _batch(seed)
    emb = torch.randn(V, H, dtype=torch.float64)
    ctx_raw = torch.randn(2, 18, TAPS * H, dtype=torch.float64)
    block_ids = block_input_ids(ids, anchors, 4, cfg.mask_token_id)
    bpos = block_positions(pos, anchors, 4)
    masks = build_layer_masks(cfg, doc, pos, anchors, valid, backend="dense")
    got = model(ctx_raw, pos, emb[block_ids], bpos, masks, mask_slots=mask_slots)
    ref_masks = [mask_ref(doc, pos, anchors, valid, 4, cfg.window_of(i), cfg.causal_in_block_of(i)) for i in range(2)]
    want = reference_forward(model, ctx_raw, pos, emb[block_ids], bpos, ref_masks)
    # float32 RoPE tables bound the agreement; a wrong mask or projection is off by O(1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_mask_slots_project_the_first_layers_mask_row_once_with_the_same_gradients():
    """`mask_slots`: the first layer's q/k/v see the N anchor rows and one mask row (not N*B
    rows); outputs and every parameter's gradient equal the plain forward's."""
    torch.manual_seed(4)
    cfg = tiny_config()
    model = DFlashDrafter(cfg).double()
    ids, pos, doc, loss, anchors, valid = _batch(4)
    emb = torch.randn(V, H, dtype=torch.float64)
    ctx_raw = torch.randn(2, 18, TAPS * H, dtype=torch.float64)
    block_emb = emb[block_input_ids(ids, anchors, 4, cfg.mask_token_id)]
    bpos = block_positions(pos, anchors, 4)
    masks = build_layer_masks(cfg, doc, pos, anchors, valid, backend="dense")
    upstream = torch.randn(2, anchors.shape[1] * 4, H, dtype=torch.float64)
    rows_seen, results = [], []
    first = model.layers[0].self_attn
    hooks = [m.register_forward_pre_hook(lambda mod, args: rows_seen.append(args[0].shape[:-1]))
             for m in (first.q_proj, first.k_proj, first.v_proj)]
    for mask_slots in (False, True):
        model.zero_grad()
        rows_seen.clear()
        out = model(ctx_raw, pos, block_emb, bpos, masks, mask_slots=mask_slots)
        (out * upstream).sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, list(rows_seen)))
    for h in hooks:
        h.remove()
    (out0, grads0, rows0), (out1, grads1, rows1) = results
    torch.testing.assert_close(out1, out0, rtol=1e-12, atol=1e-12)
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-10, atol=1e-12, msg=name)
    N = anchors.shape[1]
    context = (2, 18)  # k/v of the context are projected for every position either way
    assert sorted(rows0) == sorted([(2, 4 * N)] * 3 + [context] * 2)
    assert sorted(rows1) == sorted([(2, N), (2, 1)] * 3 + [context] * 2)


def test_block_inputs_and_positions():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    pos = torch.tensor([[0, 1, 0, 1, 2]])
    anchors = torch.tensor([[1, 3]])
    assert block_input_ids(ids, anchors, 3, 99).tolist() == [[6, 99, 99, 8, 99, 99]]
    assert block_positions(pos, anchors, 3).tolist() == [[1, 2, 3, 1, 2, 3]]


def test_outputs_ignore_other_documents_and_the_anchor_future():
    """End-to-end leak test: a block's output depends only on its document's context before it."""
    torch.manual_seed(0)
    cfg = tiny_config(layer_types=["full_attention", "full_attention"], sliding_window=None)
    model = DFlashDrafter(cfg)
    S = 20
    doc = torch.tensor([[0] * 10 + [1] * 10])
    pos = torch.tensor([list(range(10)) * 2])
    ids = torch.randint(0, V - 1, (1, S))
    anchors = torch.tensor([[4, 14]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    emb = torch.randn(V, H)
    ctx_raw = torch.randn(1, S, TAPS * H)

    def run(c):
        masks = build_layer_masks(cfg, doc, pos, anchors, valid, backend="dense")
        return model(c, pos, emb[block_input_ids(ids, anchors, 4, cfg.mask_token_id)], block_positions(pos, anchors, 4), masks)

    base = run(ctx_raw)
    changed = ctx_raw.clone()
    changed[0, 10:] += 5.0  # all of document 1
    out = run(changed)
    torch.testing.assert_close(out[0, :4], base[0, :4])  # block of doc 0 untouched
    assert not torch.allclose(out[0, 4:], base[0, 4:])
    changed = ctx_raw.clone()
    changed[0, 4:10] += 5.0  # the anchor's own state and everything after it in doc 0
    torch.testing.assert_close(run(changed)[0, :4], base[0, :4])
    changed = ctx_raw.clone()
    changed[0, 3] += 5.0  # just before the anchor: must matter
    assert not torch.allclose(run(changed)[0, :4], base[0, :4])


def test_step_backward_reaches_drafter_parameters_only():
    torch.manual_seed(0)
    cfg = tiny_config()
    model = DFlashDrafter(cfg)
    ids, pos, doc, loss, _, _ = _batch(3)
    heads = FrozenHeads(torch.randn(V, H), torch.randn(V, H))
    taps = torch.randn(2, 18, TAPS * H, requires_grad=False)
    stats = drafter_step(
        model, heads, packed(ids, pos, doc, loss), TargetOutput(taps, None),
        step_cfg=StepConfig(num_anchors=4, noise_sigma=0.1), loss_cfg=LossConfig(),
        generator=torch.Generator().manual_seed(0),
    )
    (stats.loss_sum / stats.weight_sum).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert heads.embed_weight.grad is None and heads.lm_head_weight.grad is None
    assert taps.grad is None
    names = {n for n, _ in model.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)


@pytest.mark.parametrize("fixed_shape,fused_head,wrapped", [(True, True, ["_softmax_minus_onehot_into_logits"]), (True, False, []),
                                                            (False, True, [])])
def test_compiled_mode_compiles_the_tested_head_chunk_math(monkeypatch, fixed_shape, fused_head, wrapped):
    """Compiled mode (fixed shapes) with loss.fused_head runs the LM head's chunk math through
    `compiled_once`, on exactly the function the loss tests check, and to the same numbers
    (here the wrapper is the identity: compiling on a CPU costs tens of seconds)."""
    seen = []
    monkeypatch.setattr(head_kernel, "compiled_once", lambda fn: seen.append(fn.__name__) or fn)
    torch.manual_seed(0)
    model = DFlashDrafter(tiny_config())
    ids, pos, doc, loss, _, _ = _batch(3)
    heads = FrozenHeads(torch.randn(V, H), torch.randn(V, H))
    taps = torch.randn(2, 18, TAPS * H)

    def step(fixed, fused):
        return drafter_step(model, heads, packed(ids, pos, doc, loss), TargetOutput(taps, None),
                            step_cfg=StepConfig(num_anchors=4, fixed_shape=fixed),
                            loss_cfg=LossConfig(fused_head=fused), generator=torch.Generator().manual_seed(0))

    got = step(fixed_shape, fused_head)
    assert seen == wrapped
    want = step(fixed_shape, False)
    torch.testing.assert_close(got.loss_sum, want.loss_sum, rtol=0, atol=0)


def test_noise_only_in_training_mode():
    torch.manual_seed(0)
    model = DFlashDrafter(tiny_config())
    x = torch.randn(1, 5, TAPS * H)
    model.eval()
    torch.testing.assert_close(model.project_context(x, 0.5), model.project_context(x, 0.0))
    model.train()
    assert not torch.allclose(model.project_context(x, 0.5), model.project_context(x, 0.0))


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_rope_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from dflash_train.drafter.config import drafter_config_from_target

    params = {"rope_type": "default", "rope_theta": 5000.0} if scaling is None else {"rope_theta": 5000.0, **scaling}
    target = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=6,
                         intermediate_size=96, vocab_size=50, max_position_embeddings=512, rope_parameters=params)
    cfg = drafter_config_from_target(target, mask_token_id=3)
    ours, scale = rope_inverse_frequencies(cfg)
    theirs = LlamaRotaryEmbedding(target)
    torch.testing.assert_close(ours, theirs.inv_freq.float())
    assert scale == pytest.approx(theirs.attention_scaling)


@pytest.mark.parametrize("fixed_shape", [False, True])
def test_target_labels_finished_after_the_drafter_equal_the_direct_ones(fixed_shape):
    """drafter_forward queues the drafter between the two halves of PendingTargetLabels (the
    host read of the distinct-row count waits only for the target); the labels must be exactly
    target_block_labels' on the same anchors, and the hidden states those of the data-label run."""
    torch.manual_seed(0)
    model = DFlashDrafter(tiny_config())
    ids, pos, doc, loss, _, _ = _batch(3)
    heads = FrozenHeads(torch.randn(V, H), torch.randn(V, H))
    taps, final = torch.randn(2, 18, TAPS * H), torch.randn(2, 18, H)

    def forward(source):
        return drafter_forward(model, heads, input_ids=ids, position_ids=pos, document_ids=doc, loss_mask=loss,
                               taps=taps, final_hidden=final, generator=torch.Generator().manual_seed(0),
                               step_cfg=StepConfig(num_anchors=4, fixed_shape=fixed_shape, label_source=source))

    out, data = forward("target"), forward("data")
    want, want_valid = target_block_labels(final, heads.lm_head_weight, doc, loss, out.anchors, out.valid,
                                           model.config.block_size)
    assert torch.equal(out.labels, want) and torch.equal(out.label_valid, want_valid)
    assert torch.equal(out.label_valid, data.label_valid) and torch.equal(out.anchors, data.anchors)
    torch.testing.assert_close(out.hidden, data.hidden, rtol=0, atol=0)
    assert (out.labels[out.label_valid] != data.labels[data.label_valid]).any()  # target greedy, not the data
