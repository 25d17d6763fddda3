"""Loss and metrics of a drafter step (docs/dflash-spec.md, "Loss" and "Metrics").

Per valid label: cross-entropy of lm_head(norm(h)) with the frozen target lm_head,
weighted per slot by `decay` (exp(-(k-1)/gamma)), `cap` (the detached derivative of the
expected acceptance length with respect to log c_k, floored at eps) or both. Against
`distill` labels the target is the softmax of the target's logits, soft-capped as its own
forward caps them (`target_softcap`: Gemma 2's final_logit_softcapping); the drafter's
logits are not capped (only the target's distribution and its argmax are defined by the cap).

The step returns *sums* (weighted loss, weights, per-slot hit counts) rather than means:
the trainer divides by the weight sum of the whole global batch (all micro-batches, all
data-parallel ranks) so uneven token-budget batches do not bias the gradient, and it
reads every scalar with one host sync per log step.

The cross-entropy itself, chunked so that the [rows, vocab] logits never exist at once, is
drafter/head_kernel.py; this module says what is weighted, summed and counted.

Shapes: R rows, N blocks of B slots (slot 0 the anchor, slots 1..B-1 drafted), H hidden,
V vocabulary, r the dspark bigram head's rank (drafter/dspark.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

from dflash_train.drafter.head_kernel import RowWeigher, head_cross_entropy, weighted_head_cross_entropy
from dflash_train.utils.config import refuse_unread

WEIGHTINGS = ("decay", "cap", "cap+decay", "dpace", "uniform")
CONFIDENCE_WEIGHTINGS = ("cap", "cap+decay", "dpace")  # need the drafter's probability of each label
DPACE_ALPHA = 0.5  # loss.dpace_alpha's default: another value without weighting dpace is refused


def default_gamma(block_size: int) -> float:
    """Decay constant: 7 for B=16, 5 for B=10, 4 for B=8 (spec), ~0.45*B in between."""
    return float(math.floor(0.45 * block_size + 0.5))


@dataclass
class LossConfig:
    weighting: Literal["decay", "cap", "cap+decay", "dpace", "uniform"] = "decay"
    """per-slot loss weights: exponential decay, acceptance-aware (cap), both, D-PACE's
    acceptance-aware weights (dpace: affine smoothing instead of cap's power), or uniform"""
    gamma: float | None = None
    """decay constant (default: 7 for block 16, 5 for 10, 4 for 8)"""
    cap_alpha: float = 0.5
    """weight of the acceptance-aware term in cap+decay"""
    cap_eps: float = 1e-2
    """floor of the acceptance-aware weights"""
    dpace_alpha: float = DPACE_ALPHA
    """D-PACE's smoothing toward 1: a slot's confidence is dpace_alpha + (1 - dpace_alpha) * p"""
    chunk_rows: int = 4096
    """rows of the [rows, vocab] logits computed at once (memory vs speed); rounded down to whole
    blocks (a multiple of block_size - 1), at least one block"""
    fused_head: bool = True
    """in compiled mode (run.compile), torch.compile the softmax / cross-entropy gradient between
    the LM head's two matmuls so it is one pass over each [chunk_rows, vocab] block (the
    statistics before it are drafter/row_stats.py's one pass in every mode)"""

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"loss.weighting must be one of {list(WEIGHTINGS)}, got {self.weighting!r}")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"loss.gamma must be positive, got {self.gamma}")
        if not 0 < self.cap_alpha <= 1:
            raise ValueError(f"loss.cap_alpha must be in (0, 1], got {self.cap_alpha}")
        if not 0 < self.cap_eps < 1:
            raise ValueError(f"loss.cap_eps must be in (0, 1), got {self.cap_eps}")
        if not 0 < self.dpace_alpha <= 1:
            raise ValueError(f"loss.dpace_alpha must be in (0, 1], got {self.dpace_alpha}")
        refuse_unread(self, "loss", {"dpace_alpha": DPACE_ALPHA}, "weighting", "dpace")
        if self.chunk_rows < 1:
            raise ValueError("loss.chunk_rows must be >= 1")


def slot_weights(
    cfg: LossConfig, block_size: int, label_valid: torch.Tensor, p_correct: torch.Tensor | None
) -> torch.Tensor:
    """Weights [R, N, B-1] for slots k = 1..B-1; zero where the label is invalid.

    cap: c_i = p_i ** alpha (0 for invalid slots: they cannot be accepted),
    P_m = prod_{i<=m} c_i, w_k = sum_{m>=k} P_m = dE/dlog c_k, floored at eps.
    dpace: c_i = a + (1 - a) p_i (1 for invalid slots: no factor), the same suffix sum over
    valid slots only; no floor is needed, every factor is at least a.
    """
    valid = label_valid.to(torch.float32)
    k = torch.arange(1, block_size, device=label_valid.device, dtype=torch.float32)
    w = torch.ones_like(valid)
    if "decay" in cfg.weighting:
        gamma = cfg.gamma if cfg.gamma is not None else default_gamma(block_size)
        w = w * torch.exp(-(k - 1) / gamma)
    if cfg.weighting in CONFIDENCE_WEIGHTINGS:
        if p_correct is None:
            raise ValueError(f"{cfg.weighting} weighting needs the drafter's probabilities of the labels")
        p = p_correct.detach().float().clamp(0, 1)
        if cfg.weighting == "dpace":
            c = torch.where(label_valid, cfg.dpace_alpha + (1 - cfg.dpace_alpha) * p, torch.ones_like(p))
            w = w * _suffix_sum(torch.cumprod(c, dim=-1) * valid)
        else:
            w = w * _suffix_sum(torch.cumprod(p.pow(cfg.cap_alpha) * valid, dim=-1)).clamp(min=cfg.cap_eps)
    return w * valid


def _suffix_sum(x: torch.Tensor) -> torch.Tensor:
    """sum_{m >= k} x_m along the last dimension."""
    return x.flip(-1).cumsum(-1).flip(-1)


def _row_weights(cfg: LossConfig, valid: torch.Tensor) -> torch.Tensor | RowWeigher:
    """The weight of every drafted slot, in the head's row order (valid [R, N, B-1] -> [R*N*(B-1)]).
    The confidence weightings' weights come from the drafter's own CEs, so the head computes them
    block by block as each chunk's CEs are known (its chunks hold whole blocks)."""
    B = valid.shape[-1] + 1
    if cfg.weighting not in CONFIDENCE_WEIGHTINGS:
        return slot_weights(cfg, B, valid, None).reshape(-1)
    valid_rows = valid.reshape(-1, B - 1)  # [R*N, B-1]

    def row_weights(ce_chunk: torch.Tensor, rows: slice) -> torch.Tensor:  # whole blocks
        blocks = slice(rows.start // (B - 1), rows.stop // (B - 1))
        return slot_weights(cfg, B, valid_rows[blocks], torch.exp(-ce_chunk.view(-1, B - 1))).reshape(-1)

    return row_weights


@dataclass
class StepStats:
    """Sums over one micro-batch (tensors on device: read them all at once when logging)."""

    loss_sum: torch.Tensor  # differentiable: sum of weight * CE
    weight_sum: torch.Tensor  # sum of weights (detached); the loss normaliser
    ce_sum: torch.Tensor  # unweighted CE sum over valid labels (detached)
    correct: torch.Tensor  # [B-1] hits per slot k = 1..B-1
    counted: torch.Tensor  # [B-1] valid labels per slot
    tau_sum: torch.Tensor  # sum over blocks with a valid label of 1 + leading hits
    blocks: torch.Tensor  # number of such blocks
    reached: torch.Tensor  # [B-1] blocks whose round accepts at least k drafts (slots 1..k all hit)

    SCALARS = ("loss_sum", "weight_sum", "ce_sum", "tau_sum", "blocks")
    PER_SLOT = ("correct", "counted", "reached")

    def detached(self) -> StepStats:
        return dataclasses.replace(self, loss_sum=self.loss_sum.detach())

    def flat(self, dtype: torch.dtype) -> torch.Tensor:
        """[5 + 3 (B-1)] of `dtype`, detached: the scalars, then each per-slot count (the one
        vector that sums, all-reduces or reads back every field at once)."""
        scalars = torch.stack([getattr(self, f).detach().to(dtype).reshape(()) for f in self.SCALARS])
        return torch.cat([scalars, *(getattr(self, f).detach().to(dtype) for f in self.PER_SLOT)])

    @classmethod
    def from_flat(cls, flat: torch.Tensor) -> StepStats:
        """The inverse of `flat`."""
        n = (len(flat) - len(cls.SCALARS)) // len(cls.PER_SLOT)
        slots = flat[len(cls.SCALARS):].view(len(cls.PER_SLOT), n)
        return cls(**dict(zip(cls.SCALARS, flat)), **dict(zip(cls.PER_SLOT, slots)))


def drafter_loss(
    final_hidden: torch.Tensor,  # [R, N*B, H] drafter output (already normed)
    lm_head_weight: torch.Tensor,  # [V, H]
    labels: torch.Tensor,  # [R, N, B] (IGNORE where invalid)
    label_valid: torch.Tensor,  # [R, N, B]
    cfg: LossConfig,
    *,
    target_states: torch.Tensor | None = None,  # [R, N, B-1, H] for distillation
    compiled: bool = False,  # compiled mode (fixed shapes): the head's chunk math compiled (cfg.fused_head)
    tail: torch.Tensor | None = None,  # [V, r] dspark's markov_w2; final_hidden is then [R, N*B, H + r]
    target_softcap: float | None = None,  # the target's final_logit_softcapping, applied to its distilled logits
) -> StepStats:
    """The spec's loss and metrics of one micro-batch, as sums: the CE of every drafted slot
    (against its label, or the target's distribution with `target_states`), weighted by
    `slot_weights`, and the hits of each slot and of each block's leading run."""
    R, N, B = labels.shape
    H = final_hidden.shape[-1]
    hidden = final_hidden.view(R, N, B, H)[:, :, 1:].reshape(-1, H)  # [R*N*(B-1), H]: slot 0 is never a label
    lab = labels[:, :, 1:].reshape(-1)  # [R*N*(B-1)]
    valid = label_valid[:, :, 1:]  # [R, N, B-1]
    soft = target_states.reshape(-1, target_states.shape[-1]) if target_states is not None else None
    # the head forms the weighted sum (and a tail's gradient) itself, chunk by chunk
    ce, pred, loss_sum, weights = weighted_head_cross_entropy(
        hidden, lm_head_weight, None if soft is not None else lab, _row_weights(cfg, valid),
        target_hidden=soft, chunk_rows=cfg.chunk_rows, compiled=compiled and cfg.fused_head, tail=tail,
        group_rows=B - 1, target_softcap=target_softcap)
    ce = ce.view(R, N, B - 1)
    vf = valid.float()
    hits = (pred.view(R, N, B - 1) == labels[:, :, 1:]) & valid  # [R, N, B-1]
    has_label = valid.any(dim=-1)  # [R, N]
    run = hit_runs(hits)  # [R, N, B-1]
    leading = run.sum(-1)  # [R, N]
    return StepStats(
        loss_sum=loss_sum,
        weight_sum=weights.sum().detach(),
        ce_sum=(ce.detach() * vf).sum(),
        correct=hits.sum(dim=(0, 1)),
        counted=valid.sum(dim=(0, 1)),
        tau_sum=((1 + leading) * has_label).sum(),
        blocks=has_label.sum(),
        reached=run.sum(dim=(0, 1)),
    )


# ---- metrics (docs/dflash-spec.md, "Metrics every trainer must report") ----------------------

def hit_runs(hits: torch.Tensor) -> torch.Tensor:
    """[..., B-1] per-slot hits -> [..., B-1] 1 while every slot so far hit: summed over the
    slots, the drafts a speculative round would accept (the round then commits 1 + that many)."""
    return torch.cumprod(hits.long(), dim=-1)


def leading_hits(hits: torch.Tensor) -> torch.Tensor:
    """[..., B-1] per-slot hits -> [...] drafts a speculative round would accept."""
    return hit_runs(hits).sum(-1)


def block_acceptance(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                     label_valid: torch.Tensor, chunk_rows: int = 4096,
                     tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(accepted drafts [R, N], block has a valid label [R, N]) of each block, teacher-forced:
    the drafter's greedy prediction of slot k against the label of slot k (no gradient).
    `tail`: dspark's markov_w2, with `hidden` widened by the bigram codes (drafter/dspark.py)."""
    R, N, B = labels.shape
    H = hidden.shape[-1]
    flat = hidden.detach().view(R, N, B, H)[:, :, 1:].reshape(-1, H)
    _, pred = head_cross_entropy(flat, lm_head_weight, labels[:, :, 1:].reshape(-1), None, chunk_rows,
                                 tail=None if tail is None else tail.detach())
    valid = label_valid[:, :, 1:]
    hits = (pred.view(R, N, B - 1) == labels[:, :, 1:]) & valid
    return leading_hits(hits), valid.any(dim=-1)


def summarize(stats: list[StepStats] | StepStats) -> dict[str, float]:
    """Host-side metrics from accumulated sums: loss, ce, tau, acc_k (slot k hits, whatever
    came before it) and reach_k (rounds accepting at least k drafts: tau = 1 + the sum of the
    reach_k; a slot's hits count towards tau only where every slot before it hit). One sync."""
    if isinstance(stats, StepStats):
        stats = [stats]
    sums = StepStats.from_flat(torch.stack([s.flat(torch.float64) for s in stats]).sum(0).cpu())  # the only host sync
    loss_sum, weight_sum, ce_sum, tau_sum, blocks = (float(getattr(sums, f)) for f in StepStats.SCALARS)
    corr, cnt, reach = sums.correct.tolist(), sums.counted.tolist(), sums.reached.tolist()
    nslots = len(corr)
    total = sum(cnt)
    out = {
        "loss": loss_sum / weight_sum if weight_sum else float("nan"),
        "ce": ce_sum / total if total else float("nan"),
        "tau": tau_sum / blocks if blocks else float("nan"),
        "labels": total,
    }
    for k in range(nslots):
        out[f"acc_{k + 1}"] = corr[k] / cnt[k] if cnt[k] else float("nan")
    for k in range(nslots):
        out[f"reach_{k + 1}"] = reach[k] / blocks if blocks else float("nan")
    return out
