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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from dflash_train.drafter.row_stats import row_stats
from dflash_train.target.ops import soft_cap
from dflash_train.utils.compile import compiled_once

# a chunk's weights from its CEs: (ce [c] float32, detached; the chunk's rows of the head's input) -> [c]
RowWeigher = Callable[[torch.Tensor, slice], torch.Tensor]

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
        if self.dpace_alpha != DPACE_ALPHA and self.weighting != "dpace":  # set, and it would be ignored
            raise ValueError(f"loss.dpace_alpha ({self.dpace_alpha}) applies to loss.weighting dpace; the weighting "
                             f"is {self.weighting!r}: set loss.weighting dpace, or leave dpace_alpha out")
        if self.chunk_rows < 1:
            raise ValueError("loss.chunk_rows must be >= 1")


def _log_sum_exp(lf: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(lf))) over the vocabulary: [c, V] float32 -> [c]. Spelled as the max,
    then the sum of exp(x - max): the pattern Inductor turns into one online-softmax pass
    over the chunk (torch.logsumexp's guard for infinite maxima hides it, and its kernel
    then reads the chunk several times). Logits are finite; a non-finite one makes the
    loss NaN, and the step is skipped."""
    m = lf.amax(dim=-1, keepdim=True)
    return (m + (lf - m).exp().sum(dim=-1, keepdim=True).log()).squeeze(1)


def _softmax_minus_onehot(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """dCE/dlogits of one chunk: exp(logit - lse) with 1 taken off at the label, in the head's
    dtype [c, V]; labels outside [0, V) take nothing off. The compiled form (compiled mode): the
    one-hot is a pointwise op, which Inductor fuses into the one kernel that reads the logits and
    writes the gradient (a scatter made it write the float32 probabilities out and read them
    back: two more passes over [c, V])."""
    probs = torch.exp(logits.float() - lse[:, None])
    is_label = torch.arange(logits.shape[1], device=logits.device) == labels[:, None]
    return probs.sub_(is_label.to(torch.uint8)).to(logits.dtype)


def _softmax_minus_onehot_eager(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The same numbers without a compiler, in three passes over the [c, V] chunk instead of the
    one-hot form's seven (its cast, subtract, exp, compare, cast, subtract, cast): the subtract
    reads the head's dtype and writes float32 (type promotion), exp runs in place, and the 1 is
    taken off at the c label positions alone. The chunk is the step's largest tensor (rows x
    vocabulary), so on a GPU each pass is milliseconds."""
    probs = torch.sub(logits, lse[:, None]).exp_()  # [c, V] float32
    valid = (labels >= 0) & (labels < logits.shape[1])
    rows = torch.arange(labels.shape[0], device=labels.device)
    # one indexed add of -1 (of -0 where the label is out of range): each row's position once
    probs.index_put_((rows, torch.where(valid, labels, 0)), -valid.to(probs.dtype), accumulate=True)
    return probs.to(logits.dtype)


def _hard_label_chunk(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool,
                      onehot_grad=_softmax_minus_onehot_eager):
    """One chunk against hard labels: logits [c, V] in the head's dtype, labels [c] ->
    (CE [c] float32, argmax [c], dCE/dlogits = softmax - onehot [c, V] in the head's dtype or None).
    The statistics are one read of the chunk (drafter/row_stats.py; a Triton kernel on the GPU),
    the gradient one more read and a write when compiled (compiled mode), three when eager."""
    lse, label_logit, pred = row_stats(logits, labels)
    ce = lse - label_logit
    return ce, pred, onehot_grad(logits, lse, labels) if need_grad else None


def _soft_target_chunk(logits: torch.Tensor, target_logits: torch.Tensor, need_grad: bool):
    """The same against the target's distribution softmax(target_logits) (distillation)."""
    lf = logits.float()
    lse = _log_sum_exp(lf)
    soft = torch.softmax(target_logits.float(), dim=-1)
    ce = lse - (soft * lf).sum(-1)
    pred = lf.argmax(dim=-1)
    if not need_grad:
        return ce, pred, None
    return ce, pred, (torch.exp(lf - lse[:, None]) - soft).to(logits.dtype)


class _HeadCrossEntropy(torch.autograd.Function):
    """Cross-entropy of hidden @ W.T against hard labels or a soft target, chunked.

    The [rows, V] logits exist only one chunk at a time. Because W is frozen, the gradient
    with respect to the hidden states is (softmax - target) @ W per row, times the
    incoming gradient of that row's loss: it is computed in the forward chunk loop while
    the logits are at hand and saved as a [rows, H] tensor, so the backward pass is a
    single multiply and the logits are never recomputed. Between the two matmuls each chunk
    is read twice and its gradient written once: against hard labels the statistics
    (drafter/row_stats.py), then the gradient; with `compiled` (fixed shapes: compiled mode)
    the gradient's pointwise math, and the soft target's whole chunk math, are torch.compile'd.

    The third output is the weighted sum of the CEs, `row_weights` @ ce, and the fourth the
    weights: given as a tensor (the static weightings), or as a function of a chunk's detached
    CEs (the confidence weightings, each block's weights from its own slots' CEs: the chunks
    hold whole blocks). The sum's gradient is one scalar, so a trainable tail's gradient
    (dspark's markov_w2), sum over rows of weight * (softmax - target) (x) code, is accumulated
    in the same forward loop and only scaled in the backward pass. Without the weights, a tail's
    gradient needs each row's incoming gradient, known only in the backward pass, which then
    computes every chunk's logits again (`_tail_grad`).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, target_hidden, chunk_rows: int, need_grad: bool, compiled: bool,
                tail=None, row_weights=None, target_softcap=None):
        rows = hidden.shape[0]
        ce = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        pred = torch.empty(rows, dtype=torch.long, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_grad else None
        weigh = row_weights if callable(row_weights) else None
        if weigh is not None:  # filled chunk by chunk, from each chunk's CEs
            row_weights = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        w = weight  # frozen, often bf16: cast the small hidden chunks, never the [V, H] matrix
        tail_w = tail.detach().to(w.dtype) if tail is not None else None  # [V, r], small
        train_tail = tail is not None and need_grad and tail.requires_grad
        folded = torch.zeros(tail.shape, dtype=torch.promote_types(tail.dtype, torch.float32), device=tail.device) \
            if train_tail and row_weights is not None else None
        chunk_fn = _chunk_fn(target_hidden is None, compiled)
        for start in range(0, rows, chunk_rows):
            sl = slice(start, start + chunk_rows)
            logits = _head_logits(hidden[sl], w, tail_w)  # [c, V]
            if target_hidden is None:
                ce[sl], pred[sl], grad_logits = _hard_label_chunk(logits, labels[sl], need_grad, chunk_fn)
            else:
                ce[sl], pred[sl], grad_logits = chunk_fn(logits, _target_logits(target_hidden[sl], w, target_softcap),
                                                         need_grad)
            if weigh is not None:
                row_weights[sl] = weigh(ce[sl], sl)
            if need_grad:
                grad_hidden[sl] = _head_back(grad_logits, w, tail_w).to(hidden.dtype)
            if folded is not None:  # weight each row on the small [c, r] codes, not the [c, V] gradient
                codes = hidden[sl, w.shape[1]:] * row_weights[sl, None].to(hidden.dtype)
                folded += grad_logits.T @ codes.to(grad_logits.dtype)
        weighted = (ce * row_weights).sum() if row_weights is not None else ce.new_zeros(())
        weights_out = row_weights if row_weights is not None else ce.new_empty(0)
        ctx.save_for_backward(grad_hidden if need_grad else hidden.new_empty(0), weights_out)
        ctx.mark_non_differentiable(pred, weights_out)
        ctx.set_materialize_grads(False)
        ctx.folded = folded
        ctx.tail_args = (hidden.detach(), w, tail, labels, target_hidden, chunk_rows, chunk_fn,
                         target_softcap) if train_tail else None
        return ce, pred, weighted, weights_out

    @staticmethod
    def backward(ctx, grad_ce, grad_pred, grad_weighted, grad_weights):
        grad_hidden, row_weights = ctx.saved_tensors
        grad_rows = grad_ce  # [rows]: d loss / d ce, from the per-row output and the weighted sum
        if grad_weighted is not None:
            by_weight = grad_weighted * row_weights
            grad_rows = by_weight if grad_rows is None else grad_rows + by_weight
        grad_tail = None
        if ctx.tail_args is not None:
            if ctx.folded is not None and grad_weighted is not None:
                grad_tail = ctx.folded * grad_weighted
            if grad_ce is not None:  # the CEs themselves feed the loss: every chunk once more
                by_row = _tail_grad(grad_ce, *ctx.tail_args)
                grad_tail = by_row if grad_tail is None else grad_tail + by_row
            grad_tail = grad_tail.to(ctx.tail_args[2].dtype) if grad_tail is not None else None
        grad_h = None if grad_rows is None else grad_hidden * grad_rows[:, None].to(grad_hidden.dtype)
        return grad_h, None, None, None, None, None, None, grad_tail, None, None


def _chunk_fn(hard: bool, compiled: bool):
    """The per-chunk math: the one-hot gradient (hard labels) or the whole soft-target chunk;
    each hard-label form is the one its mode runs fastest."""
    if hard:
        return compiled_once(_softmax_minus_onehot) if compiled else _softmax_minus_onehot_eager
    return compiled_once(_soft_target_chunk) if compiled else _soft_target_chunk


def _head_logits(hidden: torch.Tensor, w: torch.Tensor, tail_w: torch.Tensor | None) -> torch.Tensor:
    """[c, H] @ w.T; with a tail (dspark), [c, H + r] against [w | tail_w]: the LM head's logits plus
    the bigram bias, two matmuls into one [c, V] (the [V, H + r] weight is never built)."""
    if tail_w is None:
        return hidden.to(w.dtype) @ w.T
    H = w.shape[1]
    return torch.addmm(hidden[:, :H].to(w.dtype) @ w.T, hidden[:, H:].to(w.dtype), tail_w.T)


def _target_logits(target_hidden: torch.Tensor, w: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """The target's logits of a chunk, [c, H] -> [c, V] in the head's dtype, soft-capped as the target's
    own forward caps them (Gemma 2's final_logit_softcapping): the distribution distilled is the target's."""
    return soft_cap(target_hidden.to(w.dtype) @ w.T, softcap)


def _head_back(grad_logits: torch.Tensor, w: torch.Tensor, tail_w: torch.Tensor | None) -> torch.Tensor:
    """dLoss/dhidden of one chunk: [c, V] -> [c, H] (or [c, H + r] with a tail)."""
    if tail_w is None:
        return grad_logits @ w
    return torch.cat([grad_logits @ w, grad_logits @ tail_w], dim=-1)


def _tail_grad(grad_ce, hidden, w, tail, labels, target_hidden, chunk_rows, chunk_fn, target_softcap) -> torch.Tensor:
    """dLoss/dtail [V, r] (dspark's markov_w2, trainable, unlike the frozen LM head). Its gradient
    needs each row's incoming weight, known only now, so each chunk's logits are computed again:
    sum over rows of grad_ce * (softmax - target) (x) markov code, in float32."""
    H = w.shape[1]
    tail_w = tail.detach().to(w.dtype)
    grad = torch.zeros(tail.shape, dtype=torch.float32, device=tail.device)
    for start in range(0, hidden.shape[0], chunk_rows):
        sl = slice(start, start + chunk_rows)
        logits = _head_logits(hidden[sl], w, tail_w)
        if target_hidden is None:
            grad_logits = _hard_label_chunk(logits, labels[sl], True, chunk_fn)[2]
        else:
            grad_logits = chunk_fn(logits, _target_logits(target_hidden[sl], w, target_softcap), True)[2]
        scaled = grad_logits.float() * grad_ce[sl, None].float()  # [c, V]
        grad += scaled.T @ hidden[sl, H:].float()
    return grad


def head_cross_entropy(
    hidden: torch.Tensor,  # [M, H]
    lm_head_weight: torch.Tensor,  # [V, H], frozen
    labels: torch.Tensor | None,  # [M] (any value where invalid; masked by weights)
    target_hidden: torch.Tensor | None = None,  # [M, H] for distillation
    chunk_rows: int = 4096,
    compiled: bool = False,
    tail: torch.Tensor | None = None,  # [V, r] dspark's markov_w2 (trainable); hidden is then [M, H + r]
    target_softcap: float | None = None,  # the target's final_logit_softcapping (distillation)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-row CE float32 [M], argmax prediction [M]) without materialising [M, V]."""
    ce, pred, _, _ = _head_ce(hidden, lm_head_weight, labels, target_hidden, chunk_rows, compiled, tail, None,
                              target_softcap)
    return ce, pred


def weighted_head_cross_entropy(
    hidden: torch.Tensor,  # [M, H] (or [M, H + r] with a tail)
    lm_head_weight: torch.Tensor,  # [V, H], frozen
    labels: torch.Tensor | None,  # [M]
    row_weights: torch.Tensor | RowWeigher,  # [M] float32 (no gradient), or computed from the CEs
    target_hidden: torch.Tensor | None = None,  # [M, H] for distillation
    chunk_rows: int = 4096,
    compiled: bool = False,
    tail: torch.Tensor | None = None,  # [V, r]
    group_rows: int = 1,  # rows kept in one chunk (a block's slots): chunk_rows is rounded down to a multiple
    target_softcap: float | None = None,  # the target's final_logit_softcapping (distillation)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """head_cross_entropy plus the differentiable sum row_weights @ ce and the weights [M]; a
    loss built on that sum alone trains a tail without computing the logits a second time
    (_HeadCrossEntropy). `row_weights` as a function (RowWeigher) weighs each chunk from its
    own detached CEs as they are computed, a whole group of `group_rows` rows at a time."""
    chunk_rows = max(group_rows, chunk_rows // group_rows * group_rows)
    if not callable(row_weights):
        row_weights = row_weights.detach()
    return _head_ce(hidden, lm_head_weight, labels, target_hidden, chunk_rows, compiled, tail, row_weights,
                    target_softcap)


def _head_ce(hidden, lm_head_weight, labels, target_hidden, chunk_rows, compiled, tail, row_weights,
             target_softcap=None):
    if (labels is None) == (target_hidden is None):
        raise ValueError("give exactly one of labels and target_hidden")
    if labels is not None:
        labels = labels.clamp(min=0)  # IGNORE slots carry weight 0; any id is fine there
    need_grad = hidden.requires_grad or (tail is not None and tail.requires_grad)
    return _HeadCrossEntropy.apply(hidden, lm_head_weight, labels, target_hidden, chunk_rows,
                                   need_grad, compiled, tail, row_weights, target_softcap)


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

    def detached(self) -> "StepStats":
        return dataclasses.replace(self, loss_sum=self.loss_sum.detach())

    def flat(self, dtype: torch.dtype) -> torch.Tensor:
        """[5 + 3 (B-1)] of `dtype`, detached: the scalars, then each per-slot count (the one
        vector that sums, all-reduces or reads back every field at once)."""
        scalars = torch.stack([getattr(self, f).detach().to(dtype).reshape(()) for f in self.SCALARS])
        return torch.cat([scalars, *(getattr(self, f).detach().to(dtype) for f in self.PER_SLOT)])

    @classmethod
    def from_flat(cls, flat: torch.Tensor) -> "StepStats":
        """The inverse of `flat`."""
        n = (len(flat) - len(cls.SCALARS)) // len(cls.PER_SLOT)
        slots = flat[len(cls.SCALARS):].view(len(cls.PER_SLOT), n)
        return cls(**dict(zip(cls.SCALARS, flat)), **dict(zip(cls.PER_SLOT, slots)))


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
    `tail`: dspark's markov_w2, with `hidden` widened by the bigram codes (drafter/markov.py)."""
    R, N, B = labels.shape
    H = hidden.shape[-1]
    flat = hidden.detach().view(R, N, B, H)[:, :, 1:].reshape(-1, H)
    _, pred = head_cross_entropy(flat, lm_head_weight, labels[:, :, 1:].reshape(-1), None, chunk_rows,
                                 tail=None if tail is None else tail.detach())
    valid = label_valid[:, :, 1:]
    hits = (pred.view(R, N, B - 1) == labels[:, :, 1:]) & valid
    return leading_hits(hits), valid.any(dim=-1)


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
    R, N, B = labels.shape
    H = final_hidden.shape[-1]
    hidden = final_hidden.view(R, N, B, H)[:, :, 1:].reshape(-1, H)  # slot 0 is never a label
    lab = labels[:, :, 1:].reshape(-1)
    valid = label_valid[:, :, 1:]
    soft = target_states.reshape(-1, target_states.shape[-1]) if target_states is not None else None
    head_args = (hidden, lm_head_weight, None if soft is not None else lab)
    head_kwargs = dict(target_hidden=soft, chunk_rows=cfg.chunk_rows, compiled=compiled and cfg.fused_head, tail=tail,
                       target_softcap=target_softcap)
    # the head forms the weighted sum (and a tail's gradient) itself; the confidence weightings'
    # weights come from the CEs, so it computes them block by block as each chunk's CEs are known
    if cfg.weighting in CONFIDENCE_WEIGHTINGS:
        valid_rows = valid.reshape(-1, B - 1)

        def row_weights(ce_chunk: torch.Tensor, rows: slice) -> torch.Tensor:  # whole blocks
            blocks = slice(rows.start // (B - 1), rows.stop // (B - 1))
            return slot_weights(cfg, B, valid_rows[blocks], torch.exp(-ce_chunk.view(-1, B - 1))).reshape(-1)
    else:
        row_weights = slot_weights(cfg, B, valid, None).reshape(-1)
    ce, pred, loss_sum, weights = weighted_head_cross_entropy(*head_args, row_weights, **head_kwargs,
                                                              group_rows=B - 1)
    ce = ce.view(R, N, B - 1)
    vf = valid.float()
    hits = (pred.view(R, N, B - 1) == labels[:, :, 1:]) & valid
    has_label = valid.any(dim=-1)
    run = hit_runs(hits)  # [R, N, B-1]
    leading = run.sum(-1)
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
