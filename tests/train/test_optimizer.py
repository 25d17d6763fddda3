"""CompiledAdamW: the same update as torch's AdamW step after step (weight decay, a changing lr),
the same as the fused kernel in bf16, and checkpoints that move between the two. Its update runs
eagerly here: compiling on a CPU costs tens of seconds, and the compiled function is this one."""

import copy

import pytest
import torch

from dflash_train.train import optimizer as optimizer_module
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.train.config import OptimConfig, TrainConfig
from dflash_train.train.optimizer import CompiledAdamW, build_lr_scheduler, build_optimizer, build_param_groups

from ..drafter.test_model import tiny_config

HYPER = dict(lr=0.05, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    monkeypatch.setattr(optimizer_module, "compiled_once", lambda fn: fn)


def params(seed: int, dtype=torch.float32) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in ((7, 5), (5,), (3, 4, 2))]


def set_grads(ps, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def test_matches_torch_adamw_over_steps_with_a_changing_lr():
    ours, ref = params(0), params(0)
    cfg = OptimConfig(lr=0.05, warmup_steps=2, weight_decay=0.1)
    opt = build_optimizer(ours, cfg, compiled=True)
    ref_opt = torch.optim.AdamW(ref, **HYPER, foreach=False)
    sched, ref_sched = build_lr_scheduler(opt, cfg, lambda: 6), build_lr_scheduler(ref_opt, cfg, lambda: 6)
    for k in range(6):
        set_grads(ours, k)
        set_grads(ref, k)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    for a, b in zip(ours, ref):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[a][key], ref_opt.state[b][key], rtol=1e-6, atol=1e-9)
        assert float(opt.state[a]["step"]) == 6


def test_bf16_matches_the_fused_kernel_with_its_hooks():
    """grad_scale divides, found_inf skips (steps too), the fp32 math is stored in bf16."""
    ours, ref = params(1, torch.bfloat16), params(1, torch.bfloat16)
    opt, ref_opt = CompiledAdamW(ours, **HYPER), torch.optim.AdamW(ref, **HYPER, fused=True)
    for k, (scale, skip) in enumerate([(2.0, 0.0), (0.5, 1.0), (3.0, 0.0)]):
        set_grads(ours, 10 + k)
        set_grads(ref, 10 + k)
        for o in (opt, ref_opt):
            o.grad_scale, o.found_inf = torch.tensor(scale), torch.tensor(skip)
            o.step()
        for a, b in zip(ours, ref):  # one bf16 rounding apart at most
            assert ((a.float() - b.float()).abs() <= b.float().abs() * 2 ** -7 + 1e-6).all()
    assert float(opt.state[ours[0]]["step"]) == float(ref_opt.state[ref[0]]["step"]) == 2


@pytest.mark.parametrize("first_compiled", [True, False])
def test_a_checkpoint_moves_between_the_two(first_compiled):
    cfg = OptimConfig(lr=0.05, weight_decay=0.1)
    ps = params(2)
    first = build_optimizer(ps, cfg, compiled=first_compiled)
    for k in range(2):
        set_grads(ps, k)
        first.step()
    state = copy.deepcopy(first.state_dict())
    assert state["param_groups"] == build_optimizer(params(3), cfg, compiled=not first_compiled).state_dict()["param_groups"]
    a, b = [p.detach().clone().requires_grad_() for p in ps], [p.detach().clone().requires_grad_() for p in ps]
    same, other = build_optimizer(a, cfg, compiled=first_compiled), build_optimizer(b, cfg, compiled=not first_compiled)
    same.load_state_dict(copy.deepcopy(state))
    other.load_state_dict(copy.deepcopy(state))
    for k in range(2, 4):
        set_grads(a, k)
        set_grads(b, k)
        same.step()
        other.step()
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=2e-6)


@pytest.mark.parametrize("compiled", [False, True])
def test_markov_lr_scale_trains_the_bigram_head_at_its_own_lr(compiled):
    """optim.markov_lr_scale: markov_w1/w2 step exactly as AdamW at lr * scale, every other
    parameter as AdamW at lr, and the schedule keeps the ratio."""
    torch.manual_seed(0)
    model = DFlashDrafter(tiny_config(variant="dspark", markov_rank=5))
    ref = copy.deepcopy(model)
    cfg = OptimConfig(lr=0.01, warmup_steps=2, markov_lr_scale=10.0)
    groups = build_param_groups(model, cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in groups[1]["params"]) == ["markov_head.markov_w1.weight",
                                                                  "markov_head.markov_w2.weight"]
    assert len(groups[0]["params"]) + 2 == len([p for p in model.parameters() if p.requires_grad])
    opt = build_optimizer(groups, cfg, compiled=compiled)
    sched = build_lr_scheduler(opt, cfg, lambda: 5)
    hyper = dict(betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False)
    ref_head = [p for n, p in ref.named_parameters() if n.startswith("markov_head.")]
    ref_rest = [p for n, p in ref.named_parameters() if not n.startswith("markov_head.")]
    ref_opts = [torch.optim.AdamW(ref_rest, lr=cfg.lr, **hyper), torch.optim.AdamW(ref_head, lr=cfg.lr * 10, **hyper)]
    ref_scheds = [build_lr_scheduler(o, cfg, lambda: 5) for o in ref_opts]
    for k in range(3):
        set_grads(list(model.parameters()), k)
        set_grads(list(ref.parameters()), k)
        for o in (opt, *ref_opts):
            o.step()
        for s_ in (sched, *ref_scheds):
            s_.step()
        assert opt.param_groups[1]["lr"] == pytest.approx(10 * opt.param_groups[0]["lr"])
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6, msg=n)


def test_markov_lr_scale_is_refused_without_the_head():
    assert len(build_param_groups(DFlashDrafter(tiny_config()), OptimConfig())) == 1
    with pytest.raises(ValueError, match="no trainable markov_head"):
        build_param_groups(DFlashDrafter(tiny_config()), OptimConfig(markov_lr_scale=3.0))
    with pytest.raises(ValueError, match="markov_lr_scale must be > 0"):
        OptimConfig(markov_lr_scale=0.0)
    with pytest.raises(ValueError, match="drafter.variant is 'dflash'"):
        TrainConfig(optim=OptimConfig(markov_lr_scale=3.0))
