"""Targets whose head does more than h W^T: soft-capped logits (Gemma 2's final_logit_softcapping)
and scaled ones (Granite's logits_scaling): `distill` and `target` labels recomputed from the final
states and the LM head equal the distribution and greedy token of the target's own
`model(...).logits`, brute force, gradient included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_train.drafter.config import drafter_config_from_target
from dflash_train.drafter.loss import LossConfig, drafter_loss, head_cross_entropy
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.drafter.step import FrozenHeads, StepConfig, drafter_forward, drafter_step
from dflash_train.target.runner import TargetRunner
from dflash_train.train.setup import frozen_heads
from tests.families import build_model

from .test_model import packed

VOCAB, S, B = 300, 40, 4


def gemma2(cap: float):
    model = build_model("gemma2", VOCAB)
    model.config.final_logit_softcapping = cap  # the forward reads it at each call
    return model


def target_batch(model):
    """A one-document packed row [1, S], the runner's taps and final states, and the reference logits."""
    ids = torch.randint(0, VOCAB - 8, (1, S), generator=torch.Generator().manual_seed(0))
    batch = dict(input_ids=ids, position_ids=torch.arange(S)[None], document_ids=torch.zeros(1, S, dtype=torch.long),
                 loss_mask=torch.ones(1, S, dtype=torch.long))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()  # soft-capped by transformers
    runner = TargetRunner(model, [0, 2], need_final=True)
    out = runner(batch["input_ids"], batch["position_ids"], batch["document_ids"])
    runner.close()
    return batch, out, logits


def granite():
    """Granite 4 (tests/families.py), whose head divides its logits by logits_scaling = 4."""
    return build_model("granitemoehybrid", VOCAB)


def heads_of(model) -> FrozenHeads:
    return frozen_heads(model.get_input_embeddings().weight, model.get_output_embeddings().weight, model.config)


def drafter_for(model) -> DFlashDrafter:
    cfg = drafter_config_from_target(model.config, mask_token_id=VOCAB - 1, num_hidden_layers=1, block_size=B,
                                     target_layer_ids=[0, 2])
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(std=0.2)
    return drafter


def brute_force_distill(hidden, w, anchors, label_valid, ref_logits):
    """Sum over valid slots (r, j, k >= 1) of CE(softmax(ref_logits at a_j + k - 1), drafter logits)."""
    R, N = anchors.shape
    H = hidden.shape[-1]
    drafter_logp = F.log_softmax(hidden.view(R, N, B, H) @ w.T, dim=-1)
    total = hidden.new_zeros(())
    for r in range(R):
        for j in range(N):
            for k in range(1, B):
                if label_valid[r, j, k]:
                    p = F.softmax(ref_logits[r, anchors[r, j] + k - 1], dim=-1)
                    total = total - (p * drafter_logp[r, j, k]).sum()
    return total


# Gemma 2's own cap, one that changes the numbers a lot, and Granite's scaled logits
@pytest.mark.parametrize("target", ["gemma2-cap30", "gemma2-cap3", "granite"])
def test_distill_loss_equals_the_brute_force_of_the_models_own_logits(target):
    model = granite() if target == "granite" else gemma2(float(target.removeprefix("gemma2-cap")))
    batch, out, ref_logits = target_batch(model)
    heads = heads_of(model)
    assert (heads.logit_softcap, heads.logit_scale) == \
        ((None, 0.25) if target == "granite" else (float(target.removeprefix("gemma2-cap")), 1.0))
    drafter = drafter_for(model)
    step_cfg = StepConfig(num_anchors=6, label_source="distill")
    fwd = drafter_forward(drafter, heads, taps=out.taps, final_hidden=out.final_hidden, step_cfg=step_cfg,
                          generator=torch.Generator().manual_seed(1), **batch)
    assert int(fwd.label_valid.sum()) >= 12
    hidden = fwd.hidden.detach().requires_grad_()
    loss_cfg = LossConfig(weighting="uniform")  # every valid slot weighs 1: loss_sum is the plain CE sum
    stats = drafter_loss(hidden, heads.lm_head_weight, fwd.labels, fwd.label_valid, loss_cfg,
                         target_states=fwd.target_states, target_softcap=heads.logit_softcap)
    stats.loss_sum.backward()
    ref_hidden = fwd.hidden.detach().requires_grad_()
    ref = brute_force_distill(ref_hidden, heads.lm_head_weight, fwd.anchors, fwd.label_valid, ref_logits)
    ref.backward()
    # fp32 sums of ~120 nats: 1e-4 absolute (measured 8e-6); the cap of 30 alone moves the sum by 0.026
    torch.testing.assert_close(stats.loss_sum, ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(stats.ce_sum, ref.detach(), rtol=0, atol=1e-4)
    torch.testing.assert_close(hidden.grad, ref_hidden.grad, rtol=1e-4, atol=1e-6)

    # the whole step (FrozenHeads -> the loss) carries the cap and scale: the same sum from the same anchors
    step = drafter_step(drafter, heads, packed(**batch), out, step_cfg=step_cfg, loss_cfg=loss_cfg,
                        generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(step.loss_sum.detach(), ref.detach(), rtol=0, atol=1e-4)

    # and the reference can tell: with plain h W^T logits the sum is off by far more than the tolerance
    plain = FrozenHeads(heads.embed_weight, heads.lm_head_weight)
    fwd = drafter_forward(drafter, plain, taps=out.taps, final_hidden=out.final_hidden, step_cfg=step_cfg,
                          generator=torch.Generator().manual_seed(1), **batch)
    uncapped = drafter_loss(fwd.hidden.detach(), heads.lm_head_weight, fwd.labels, fwd.label_valid, loss_cfg,
                            target_states=fwd.target_states)
    assert abs(float(uncapped.loss_sum) - float(ref.detach())) > 0.02


def test_target_labels_are_the_greedy_tokens_of_the_capped_logits():
    model = gemma2(3.0)
    batch, out, ref_logits = target_batch(model)
    fwd = drafter_forward(drafter_for(model), heads_of(model), taps=out.taps, final_hidden=out.final_hidden,
                          step_cfg=StepConfig(num_anchors=6, label_source="target"),
                          generator=torch.Generator().manual_seed(1), **batch)
    greedy = ref_logits[0].argmax(-1)
    for j, a in enumerate(fwd.anchors[0].tolist()):
        for k in range(1, B):
            if fwd.label_valid[0, j, k]:
                assert int(fwd.labels[0, j, k]) == int(greedy[a + k - 1])


def test_head_cross_entropy_caps_the_target_in_every_chunk():
    g = torch.Generator().manual_seed(0)
    M, H, V, cap = 9, 8, 23, 2.0
    hidden = torch.randn(M, H, generator=g, dtype=torch.float64)
    target = torch.randn(M, H, generator=g, dtype=torch.float64) * 3
    w = torch.randn(V, H, generator=g, dtype=torch.float64)
    for chunk in (1, 4, 64):
        ce, _ = head_cross_entropy(hidden, w, None, target_hidden=target, chunk_rows=chunk, target_softcap=cap)
        p = F.softmax(cap * torch.tanh(target @ w.T / cap), dim=-1)
        ref = -(p * F.log_softmax(hidden @ w.T, dim=-1)).sum(-1)
        torch.testing.assert_close(ce.double(), ref, rtol=1e-6, atol=1e-6)
