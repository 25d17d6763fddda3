"""One drafter training step on one batch: anchors -> labels -> masks -> forward -> loss.

Shared by the single-process trainer, the distributed pipeline and the benchmark, so
every path computes exactly the same thing. Returns sums (see drafter/loss.py); the
caller does backward and normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from dflash_train.data.batch import PackedBatch
from dflash_train.drafter.anchors import select_anchors, trim_anchor_columns
from dflash_train.drafter.dspark import previous_tokens
from dflash_train.drafter.labels import PendingTargetLabels, build_block_labels, gather_target_states
from dflash_train.drafter.loss import LossConfig, StepStats, drafter_loss
from dflash_train.drafter.masks import build_layer_masks
from dflash_train.drafter.model import DFlashDrafter, block_input_ids, block_positions
from dflash_train.target.runner import TargetOutput
from dflash_train.utils.flex_masks import FLEX_MIN_HEAD_DIM

LABEL_SOURCES = ("data", "target", "distill")


@dataclass
class FrozenHeads:
    """The target's input embedding and LM head, frozen and never drafter parameters."""

    embed_weight: torch.Tensor  # [V, H]
    lm_head_weight: torch.Tensor  # [V, H] (may be the same storage when tied)
    logit_softcap: float | None = None  # the target's final_logit_softcapping: its logits are cap * tanh(h W^T / cap)
    logit_scale: float = 1.0  # the factor its head multiplies h W^T by before the cap (Granite, Falcon-H1, Cohere)

    def __post_init__(self) -> None:
        self.embed_weight.requires_grad_(False)
        self.lm_head_weight.requires_grad_(False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.embed_weight)


@dataclass
class StepConfig:
    """How a step draws and labels its blocks: the `step` section of a training config."""

    num_anchors: int = 512
    """blocks (anchor positions) drawn per packed row and step"""
    label_source: Literal["data", "target", "distill"] = "data"
    """labels: the data's own tokens, the target's greedy tokens, or its distribution"""
    noise_sigma: float = 0.0
    """uniform noise U(-s, s) added to the tapped hidden states during training"""
    attention: Literal["auto", "flex", "dense"] = "auto"
    """auto = FlexAttention on GPU, a dense mask on CPU (FlexAttention has no CPU backward) and for
    drafter heads under 16 dims (FlexAttention's GPU kernels need 16)"""
    # compiled mode: fixed-shape anchors (topk), no trimming, shapes fixed by padding. The run sets it
    # from run.compile: no option of its own (utils/config.py leaves `option: False` fields out)
    fixed_shape: bool = field(default=False, metadata={"option": False})

    def __post_init__(self) -> None:
        if self.label_source not in LABEL_SOURCES:
            raise ValueError(f"step.label_source must be one of {list(LABEL_SOURCES)}, got {self.label_source!r}")
        if self.num_anchors < 1 or self.noise_sigma < 0:
            raise ValueError("step.num_anchors must be >= 1 and step.noise_sigma >= 0")
        if self.attention not in ("auto", "flex", "dense"):
            raise ValueError(f"step.attention must be auto, flex or dense, got {self.attention!r}")


def mask_backend(attention: str, device: torch.device, head_dim: int) -> str:
    """The mask kind `attention` names on `device`: auto is FlexAttention's block-sparse kernel on a GPU
    for heads of >= FLEX_MIN_HEAD_DIM dims, else the dense mask of the same rule."""
    if attention != "auto":
        return attention
    return "flex" if device.type == "cuda" and head_dim >= FLEX_MIN_HEAD_DIM else "dense"


@dataclass
class BlockForward:
    """The drafter's output on a batch's blocks, with what the loss and metrics need."""

    hidden: torch.Tensor  # [R, N*B, H] final normed hidden states of the block tokens
    labels: torch.Tensor  # [R, N, B] (IGNORE where invalid)
    label_valid: torch.Tensor  # [R, N, B]
    anchors: torch.Tensor  # [R, N] sorted; invalid slots hold S - 1
    valid: torch.Tensor  # [R, N]
    target_states: torch.Tensor | None  # [R, N, B-1, H] for distillation


def drafter_forward(
    drafter: DFlashDrafter,
    heads: FrozenHeads,
    *,
    input_ids: torch.Tensor,  # [R, S]
    position_ids: torch.Tensor,  # [R, S]
    document_ids: torch.Tensor,  # [R, S]
    loss_mask: torch.Tensor,  # [R, S]
    taps: torch.Tensor,  # [R, S, n*H] tapped target hidden states (ctx_raw)
    final_hidden: torch.Tensor | None,  # [R, S, H] target final-normed states ("target"/"distill")
    step_cfg: StepConfig,
    generator: torch.Generator | None = None,
) -> BlockForward:
    """Anchors, labels, masks and the drafter forward on one batch."""
    cfg = _module(drafter).config
    B = cfg.block_size
    anchors, valid = select_anchors(
        loss_mask, document_ids, step_cfg.num_anchors, B, generator=generator, fixed_shape=step_cfg.fixed_shape
    )
    if not step_cfg.fixed_shape:
        anchors, valid = trim_anchor_columns(anchors, valid)

    target_states, pending = None, None
    if step_cfg.label_source == "data":
        labels, label_valid = build_block_labels(input_ids, document_ids, loss_mask, anchors, valid, B)
    else:
        if final_hidden is None:
            raise ValueError(f"label_source={step_cfg.label_source!r} needs the target's final hidden states")
        pending = PendingTargetLabels(document_ids, loss_mask, anchors, valid, B)  # finished after the drafter is queued
        if step_cfg.label_source == "distill":
            target_states = gather_target_states(final_hidden, anchors, B)
            if heads.logit_scale != 1.0:  # (s h) W^T = s (h W^T): the target's scaled logits
                target_states = target_states * heads.logit_scale

    backend = mask_backend(step_cfg.attention, taps.device, cfg.head_dim)
    masks = build_layer_masks(cfg, document_ids, position_ids, anchors, valid, backend=backend)
    block_ids = block_input_ids(input_ids, anchors, B, cfg.mask_token_id)
    hidden = drafter(
        taps,
        position_ids,
        heads.embed(block_ids),
        block_positions(position_ids, anchors, B),
        masks,
        noise_sigma=step_cfg.noise_sigma,
        generator=generator,
        mask_slots=True,  # block_input_ids: [anchor token, MASK, ..., MASK]
    )
    if pending is not None:
        labels, label_valid = pending.finish(final_hidden, heads.lm_head_weight, logit_softcap=heads.logit_softcap)
    return BlockForward(hidden, labels, label_valid, anchors, valid, target_states)


def _module(drafter: DFlashDrafter) -> DFlashDrafter:
    """The DFlashDrafter itself (DDP wraps it in .module; torch.compile forwards attributes)."""
    return drafter if hasattr(drafter, "config") else drafter.module


def head_operands(drafter: DFlashDrafter, out: BlockForward,
                  input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the LM-head loss reads: (hidden [R, N*B, H], None) for dflash; for dspark the hidden
    states widened by each slot's bigram code, [R, N*B, H + r], and markov_w2 [V, r] as the head's
    trainable tail (drafter/dspark.py), with teacher-forced previous tokens."""
    markov = _module(drafter).markov_head
    if markov is None:
        return out.hidden, None
    prev = previous_tokens(input_ids, out.anchors, out.labels, out.label_valid)  # [R, N, B]
    return markov.widen(out.hidden, prev.view(prev.shape[0], -1)), markov.markov_w2.weight


def drafter_step(drafter: DFlashDrafter, heads: FrozenHeads, batch: PackedBatch, target: TargetOutput, *,
                 step_cfg: StepConfig, loss_cfg: LossConfig, generator: torch.Generator | None = None) -> StepStats:
    """`drafter_forward` on a batch (on the drafter's device) and the target's output on it, then the
    loss sums and metrics."""
    out = drafter_forward(drafter, heads, input_ids=batch.input_ids, position_ids=batch.position_ids,
                          document_ids=batch.document_ids, loss_mask=batch.loss_mask, taps=target.taps,
                          final_hidden=target.final_hidden, step_cfg=step_cfg, generator=generator)
    hidden, tail = head_operands(drafter, out, batch.input_ids)
    return drafter_loss(hidden, heads.lm_head_weight, out.labels, out.label_valid, loss_cfg,
                        target_states=out.target_states, compiled=step_cfg.fixed_shape, tail=tail,
                        target_softcap=heads.logit_softcap)
