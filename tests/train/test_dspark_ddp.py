"""dspark's bigram head under data parallelism: two gloo drafter replicas (real processes) train
on two shares of the tiny target's data through the trainer's own pieces (wrap_drafter's DDP,
micro_step with no_sync over two micro-batches, apply_gradients). The head is used outside the
DDP-wrapped forward (drafter/step.py `head_operands`); its gradients must still be averaged
with the backbone's. Every parameter of both replicas must equal, bit for bit, a plain
single-process replay that averages the two shares' gradients by hand."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_train.data.batching import BatchPlanConfig, BatchPlanner
from dflash_train.data.dataset import TokenDataset
from dflash_train.drafter.config import drafter_config_from_target
from dflash_train.drafter.loss import LossConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.drafter.step import FrozenHeads, StepConfig
from dflash_train.pipeline.context import DistContext
from dflash_train.target.loading import load_causal_lm
from dflash_train.target.runner import TargetOutput, TargetRunner
from dflash_train.train.config import OptimConfig
from dflash_train.train.optimizer import build_lr_scheduler, build_optimizer
from dflash_train.train.setup import wrap_drafter
from dflash_train.train.step import apply_gradients, batch_seed, micro_step
from dflash_train.train.timing import StageTimer

STEPS, ACCUM, WORLD = 3, 2, 2
MARKOV = ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight")
STEP_CFG = StepConfig(num_anchors=8, label_source="target", attention="dense")
LOSS_CFG = LossConfig(gamma=3.0)
OPTIM = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0)


def make_inputs(target_dir: Path, data_dir: Path) -> dict:
    """The drafter's start, the frozen heads, and STEPS x WORLD x ACCUM batches with the target's
    outputs on them (share r of step s: micro-batches [s][r])."""
    model = load_causal_lm(target_dir, dtype=torch.float32)
    cfg = drafter_config_from_target(model.config, mask_token_id=3, num_hidden_layers=1, block_size=4, num_taps=2,
                                     variant="dspark", markov_rank=8)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg)
    with torch.no_grad():  # a head as strong as the backbone: its gradients are not negligible
        for name in MARKOV:
            drafter.get_parameter(name).normal_(0.0, 0.3)
    data = TokenDataset(data_dir)
    planner = BatchPlanner(data.lengths, BatchPlanConfig(token_budget=128, shuffle=False))
    runner = TargetRunner(model, cfg.target_layer_ids, need_final=True)
    batches = []
    for batch, _ in zip(planner.iter_batches(data), range(STEPS * WORLD * ACCUM)):
        out = runner.run_batch(batch, torch.device("cpu"))
        batches.append((batch, out.taps.clone(), out.final_hidden.clone()))
    runner.close()
    shares = [[batches[(s * WORLD + r) * ACCUM:(s * WORLD + r + 1) * ACCUM] for r in range(WORLD)]
              for s in range(STEPS)]
    heads = (model.get_input_embeddings().weight.detach().clone(), model.get_output_embeddings().weight.detach().clone())
    return {"config": cfg, "state": drafter.state_dict(), "heads": heads, "shares": shares}


def accumulate(model, heads, micro, *, rank: int, sync) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's micro-batch loop (train/trainer.py `_accumulate`): no_sync but on the last."""
    weight, loss = torch.zeros(()), torch.zeros(())
    for k, (batch, taps, final) in enumerate(micro):
        with sync(k):
            stats = micro_step(model, heads, batch, TargetOutput(taps, final), step_cfg=STEP_CFG, loss_cfg=LOSS_CFG,
                               device=torch.device("cpu"), timer=StageTimer(torch.device("cpu")),
                               seed=batch_seed(0, batch.epoch, batch.index * WORLD + rank))
        weight, loss = weight + stats.weight_sum.float(), loss + stats.loss_sum.float()
    return weight, loss


def fresh(inputs):
    drafter = DFlashDrafter(inputs["config"])
    drafter.load_state_dict(inputs["state"])
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, OPTIM)
    return drafter, params, optimizer, build_lr_scheduler(optimizer, OPTIM, lambda: 100)


def replica(rank: int, inputs_path: str, out_dir: str, init_file: str) -> None:
    torch.set_num_threads(1)  # the replay on rank 0 must run the same kernels the same way
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    inputs = torch.load(inputs_path, weights_only=False)
    heads = FrozenHeads(*inputs["heads"])
    drafter, params, optimizer, scheduler = fresh(inputs)
    ctx = DistContext(layout="colocated", rank=rank, world=WORLD, target_ranks=[0, 1], drafter_ranks=[0, 1],
                      drafters=dist.group.WORLD)
    model = wrap_drafter(drafter, ctx, compile=False)
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
    for step in inputs["shares"]:
        weight, loss = accumulate(model, heads, step[rank], rank=rank,
                                  sync=lambda k: model.no_sync() if k < ACCUM - 1 else contextlib.nullcontext())
        shared = torch.stack([weight, loss])
        dist.all_reduce(shared)  # the one agreement of a step (train/stopping.py)
        assert apply_gradients(params, optimizer, scheduler, global_weight=shared[0], global_loss=shared[1],
                               num_replicas=WORLD, grad_clip=OPTIM.grad_clip).applied
    torch.save(drafter.state_dict(), Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        torch.save(replay(inputs, heads), Path(out_dir) / "replay.pt")


def replay(inputs, heads) -> dict:
    """One process, no DDP: each share's gradients of the loss sums, averaged by hand as DDP
    averages them ((a + b) / 2, exact in binary floating point)."""
    drafter, params, optimizer, scheduler = fresh(inputs)
    head_grads = []
    for step in inputs["shares"]:
        grads, weight, loss = [], torch.zeros(()), torch.zeros(())
        for rank, micro in enumerate(step):
            w, l = accumulate(drafter, heads, micro, rank=rank, sync=lambda k: contextlib.nullcontext())
            grads.append([p.grad.clone() for p in params])
            weight, loss = weight + w, loss + l
            optimizer.zero_grad(set_to_none=True)
        for p, a, b in zip(params, *grads):
            p.grad = a * 0.5 + b * 0.5
        head_grads.append([{n: g for (n, _), g in zip(drafter.named_parameters(), share) if n in MARKOV}
                           for share in grads])
        assert apply_gradients(params, optimizer, scheduler, global_weight=weight, global_loss=loss,
                               num_replicas=WORLD, grad_clip=OPTIM.grad_clip).applied
    return {"state": drafter.state_dict(), "head_grads": head_grads}


def test_two_replicas_average_the_bigram_head_like_one_process(tiny_targets, tiny_datasets, tmp_path):
    inputs = make_inputs(tiny_targets["qwen3"], tiny_datasets["qwen3"])
    torch.save(inputs, tmp_path / "inputs.pt")
    mp.spawn(replica, args=(str(tmp_path / "inputs.pt"), str(tmp_path), str(tmp_path / "init")), nprocs=WORLD)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD))
    ref = torch.load(tmp_path / "replay.pt")
    for name in [*MARKOV, *inputs["state"]]:  # the head first: it is what DDP could miss
        assert torch.equal(r0[name], r1[name]), f"{name}: the replicas drifted apart"
        assert torch.equal(r0[name], ref["state"][name]), f"{name}: not the single-process average"
    for name in MARKOV:
        assert not torch.equal(r0[name], inputs["state"][name]), f"{name} did not train"
    # the test can fail: the two shares pull the head apart, so a replica that kept its own
    # head gradient would leave the other replica and the replay behind
    for step, (a, b) in enumerate(ref["head_grads"]):
        for name in MARKOV:
            assert (a[name] - b[name]).norm() > 0.1 * a[name].norm(), (step, name)
