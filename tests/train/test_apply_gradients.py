"""apply_gradients against a brute-force reference: the gradients of the loss sums times
D / (global weight), clipped by torch's rule, then plain (unfused, single-tensor) AdamW."""

import math

import pytest
import torch

from dflash_train.train.config import OptimConfig
from dflash_train.train import optimizer as optimizer_module
from dflash_train.train.optimizer import CompiledAdamW, build_lr_scheduler
from dflash_train.train.step import apply_gradients


@pytest.fixture(params=["fused", "compiled"])
def build_optimizer(request, monkeypatch):
    """Both optimizers of train/optimizer.py, each must pass every test here; CompiledAdamW runs
    its update eagerly (compiling on a CPU costs tens of seconds; the math is the same function)."""
    monkeypatch.setattr(optimizer_module, "compiled_once", lambda fn: fn)

    def build(params, cfg):
        opt = optimizer_module.build_optimizer(params, cfg, compiled=request.param == "compiled")
        assert isinstance(opt, CompiledAdamW) == (request.param == "compiled")
        return opt
    return build


def make_params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in ((7, 5), (5,), (3, 4, 2))]


def set_grads(params, seed: int, magnitude: float) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * magnitude


def reference_step(params, *, weight: float, replicas: int, clip: float, cfg: OptimConfig) -> float:
    """The step spelled out: normalise, measure (float64), clip, unfused AdamW."""
    for p in params:
        p.grad = p.grad * (replicas / weight)
    norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    if clip > 0 and norm > clip:
        for p in params:
            p.grad = p.grad * (clip / (norm + 1e-6))
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=cfg.weight_decay, foreach=False, fused=False)
    opt.step()
    return norm


@pytest.mark.parametrize("clip, magnitude", [(0.5, 3.0), (1e6, 3.0), (0.0, 40.0)])
def test_matches_the_spelled_out_step(build_optimizer, clip, magnitude):
    # Adam's first step hardly depends on the gradients' scale; a large eps makes it depend
    cfg = OptimConfig(lr=0.05, warmup_steps=0, eps=0.1)
    ours, ref = make_params(0), make_params(0)
    set_grads(ours, 1, magnitude)
    set_grads(ref, 1, magnitude)
    opt = build_optimizer(ours, cfg)
    sched = build_lr_scheduler(opt, cfg, lambda: 100)
    step = apply_gradients(ours, opt, sched, global_weight=torch.tensor(37.0), global_loss=torch.tensor(2.5),
                           num_replicas=2, grad_clip=clip)
    ref_norm = reference_step(ref, weight=37.0, replicas=2, clip=clip, cfg=cfg)
    assert step.applied
    assert float(step.grad_norm) == pytest.approx(ref_norm, rel=1e-5)
    for a, b in zip(ours, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
        assert a.grad is None  # cleared for the next step
    assert opt.state[ours[0]]["step"] == 1
    assert not hasattr(opt, "grad_scale")  # nothing left for a later step() to reuse
    assert sched.last_epoch == 1  # the schedule advanced once


def test_second_step_keeps_matching(build_optimizer):
    """Adam's moments carry the scaled gradients, not the raw ones."""
    cfg = OptimConfig(lr=0.05, warmup_steps=0)
    ours, ref = make_params(3), make_params(3)
    opt = build_optimizer(ours, cfg)
    sched = build_lr_scheduler(opt, cfg, lambda: 1_000_000)
    ref_opt = torch.optim.AdamW(ref, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=False, fused=False)
    for k, weight in enumerate((11.0, 500.0)):
        set_grads(ours, 10 + k, 2.0)
        set_grads(ref, 10 + k, 2.0)
        apply_gradients(ours, opt, sched, global_weight=torch.tensor(weight), global_loss=torch.tensor(1.0),
                        num_replicas=1, grad_clip=1.0)
        for p in ref:
            p.grad = p.grad / weight
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        for a, b in zip(ours, ref):
            assert torch.allclose(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("bad", ["grad", "loss"])
@pytest.mark.parametrize("when", ["first", "after_a_step"])
def test_non_finite_step_is_skipped(build_optimizer, bad, when):
    """The skip is decided on the device (the fused kernel's found_inf), so the step is queued
    either way: weights, moments, step counts and the schedule must come out as if the bad step
    never ran, and the next good step must match the reference that never saw it."""
    cfg = OptimConfig(lr=0.05, warmup_steps=0)
    params, ref = make_params(0), make_params(0)
    opt = build_optimizer(params, cfg)
    sched = build_lr_scheduler(opt, cfg, lambda: 1_000_000)  # lr ~constant, as the reference's
    ref_opt = torch.optim.AdamW(ref, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                weight_decay=cfg.weight_decay, foreach=False, fused=False)

    def good_step(seed: int) -> None:
        set_grads(params, seed, 1.0)
        set_grads(ref, seed, 1.0)
        assert apply_gradients(params, opt, sched, global_weight=torch.tensor(4.0), global_loss=torch.tensor(1.0),
                               num_replicas=1, grad_clip=1.0).applied
        for p in ref:
            p.grad = p.grad / 4.0
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()

    if when == "after_a_step":
        good_step(1)
    before = [p.detach().clone() for p in params]
    state_before = {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(params) if p in opt.state}
    set_grads(params, 2, 1.0)
    if bad == "grad":
        params[1].grad[2] = float("inf")
    loss = torch.tensor(float("nan") if bad == "loss" else 1.0)
    step = apply_gradients(params, opt, sched, global_weight=torch.tensor(4.0), global_loss=loss,
                           num_replicas=1, grad_clip=1.0)
    assert not step.applied
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert all(p.grad is None for p in params) and sched.last_epoch == (1 if when == "after_a_step" else 0)
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    for i, p in enumerate(params):  # a first skipped step may leave a fresh state: step 0, zero moments
        expected = state_before.get(i, {k: torch.zeros_like(v) for k, v in opt.state[p].items()})
        assert all(torch.equal(opt.state[p][k], expected[k]) for k in opt.state[p]), i
    good_step(3)
    for a, b in zip(params, ref):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    assert all(int(opt.state[p]["step"]) == int(ref_opt.state[r]["step"]) for p, r in zip(params, ref))
