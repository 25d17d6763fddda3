"""One training step, in two parts.

`micro_step`: one micro-batch through the drafter (anchors, labels, masks, forward, loss
sums; backward when training), with the batch's own anchor/noise generator.

`apply_gradients`: after all micro-batches of the step and the one agreement between
drafter replicas (train/stopping.py): normalise the gradients by the global loss weight
(the spec's global normalisation), clip, check finiteness (a host sync; a step's only other
one counts the distinct `target` label positions, drafter/labels.py) and apply the
optimizer and schedule, or skip a non-finite step.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.profiler import record_function

from dflash_train.data.batch import PackedBatch
from dflash_train.drafter.loss import LossConfig, StepStats
from dflash_train.drafter.step import FrozenHeads, StepConfig, drafter_step
from dflash_train.target.runner import TargetOutput
from dflash_train.train.stopping import WeightAndStop
from dflash_train.train.timing import StageTimer
from dflash_train.utils.device import HostCopy


def batch_seed(seed: int, epoch: int, index: int, stream: int = 0) -> int:
    """Seed of the anchor/noise generator for one batch: the same batch always draws the
    same anchors in the same run, whichever process trains it or after a resume.
    `stream` separates training (0) from evaluation (1) draws."""
    return int(np.random.SeedSequence([seed, stream, epoch, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


def autocast_for(device: torch.device):
    """bf16 autocast on GPU; CPU runs stay in the parameters' dtype."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def micro_step(model, heads: FrozenHeads, batch: PackedBatch, target_out: TargetOutput, *, step_cfg: StepConfig,
               loss_cfg: LossConfig, device: torch.device, seed: int, timer: StageTimer,
               train: bool = True) -> StepStats:
    """Drafter forward (+ backward) on one prepared CPU batch and its target output on `device`."""
    b = batch.to(device, non_blocking=True)
    generator = torch.Generator(device=device).manual_seed(seed)
    t = timer.start()
    with autocast_for(device), record_function("forward"):  # ranges named for run.profile_steps
        stats = drafter_step(model, heads, b, target_out, step_cfg=step_cfg, loss_cfg=loss_cfg, generator=generator)
    timer.stop("forward", t)
    if train:
        t = timer.start()
        with record_function("backward"):
            stats.loss_sum.backward()
        timer.stop("backward", t)
    return stats.detached()


@dataclass
class GradientStep:
    applied: bool  # False: a non-finite loss or gradient, the step was skipped
    grad_norm: torch.Tensor


class StepKind(enum.Enum):
    """How an optimizer step ended."""

    APPLIED = "applied"  # the gradients applied, the schedule stepped
    NONFINITE = "nonfinite"  # a non-finite loss or gradient: nothing applied, the step skipped
    REDO = "redo"  # a stopping target sent placeholders: nothing applied, these batches redone after resume
    NO_DATA = "no_data"  # no micro-batch was left


@dataclass
class StepOutcome:
    """What one optimizer step did."""

    kind: StepKind
    micro: list[StepStats] = field(default_factory=list)  # the micro-batches' stats
    tokens: int = 0
    exhausted: bool = False  # the data ran out during the step
    shared: WeightAndStop | None = None  # the step's all-reduce (None: no micro-batch was left)
    grad_norm: torch.Tensor | None = None  # the normalised gradient's norm, when gradients were computed

    @property
    def ends_run(self) -> bool:
        """Nothing applied and nothing to go on with: no micro-batch left, or a redo."""
        return self.kind in (StepKind.NO_DATA, StepKind.REDO)


def apply_gradients(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, scheduler, *,
                    global_weight: torch.Tensor, global_loss: torch.Tensor, num_replicas: int,
                    grad_clip: float) -> GradientStep:
    """`global_weight`/`global_loss` are the step's sums over every micro-batch and replica,
    the same on every replica, so every replica takes the same decision without talking.

    The gradients are read once (their norm) and never rewritten here: the normalisation and
    the clip are one factor that the fused AdamW applies inside its own pass, through the
    `grad_scale` it divides by (the hook torch's GradScaler uses). `optimizer` must come from
    train/optimizer.build_optimizer (torch's fused AdamW or CompiledAdamW: both take the hooks)."""
    # DDP averaged the replicas' gradients of the loss *sums*: times D / (global weight sum)
    # gives the gradient of the globally normalised loss.
    scale = num_replicas / global_weight.float().clamp(min=1e-12)
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads).float() * scale  # the normalised gradient's norm
    factor = scale
    if grad_clip > 0:  # torch's clip_grad_norm_ rule: times max_norm / (norm + 1e-6), at most 1
        factor = scale * (grad_clip / (norm + 1e-6)).clamp(max=1.0)
    finite = torch.isfinite(norm) & torch.isfinite(global_loss)
    decision = HostCopy(finite)
    # The step is queued before the host knows `finite`: the fused kernel skips every update
    # where `found_inf` is set (GradScaler's hook; the step counts are restored too), so the
    # GPU never idles while the host waits for the flag and then launches the optimizer.
    optimizer.grad_scale, optimizer.found_inf = 1.0 / factor, (~finite).float()
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf  # a later step() without them must not reuse these
    applied = bool(decision.get())  # waits for the flag, not for the optimizer queued after it
    if applied:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return GradientStep(applied, norm)
