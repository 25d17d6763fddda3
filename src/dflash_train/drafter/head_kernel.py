"""The LM head's cross-entropy, chunked: hidden [M, H] @ W.T against labels, never [M, V] at once.

The loss (drafter/loss.py) needs, for every drafted slot, the cross-entropy of the frozen
target LM head's logits and their argmax. M is rows x blocks x slots (thousands) and V the
vocabulary (up to ~250K), so the [M, V] logits would be gigabytes: `_HeadCrossEntropy` makes
them `chunk_rows` rows at a time and forms the gradient while each chunk is at hand.

What a call can ask for (each combination is one path through the one chunk loop):

    target     hard labels [M]                   `_hard_label_chunk` (drafter/row_stats.py)
               or a soft target [M, H]           `_soft_target_chunk` (distillation, soft-capped)
    tail       none, or a trainable [V, r]       the dspark bigram head (drafter/dspark.py):
                                                 hidden is then [M, H + r] against [W | tail]
    weights    none (per-row CEs only),          `head_cross_entropy`
               a tensor [M], or a RowWeigher     `weighted_head_cross_entropy`
    compiled   the chunk's pointwise math        torch.compile'd (compiled mode, fixed shapes)
               torch.compile'd or eager

Shapes: M rows, H hidden, V vocabulary, r the tail's rank, c rows in a chunk (<= chunk_rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from dflash_train.drafter.row_stats import row_stats
from dflash_train.target.ops import soft_cap
from dflash_train.utils.compile import compiled_once

# a chunk's weights from its CEs: (ce [c] float32, detached; the chunk's rows of the head's input) -> [c]
RowWeigher = Callable[[torch.Tensor, slice], torch.Tensor]


# ---- one chunk's math: [c, V] logits -> CE [c], argmax [c], dCE/dlogits [c, V] ----------------

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


def _softmax_minus_onehot_into_logits(logits: torch.Tensor, lse: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`_softmax_minus_onehot` written over the chunk's logits, which nothing reads afterwards: what
    compiled mode runs. Inductor makes it the same one kernel, storing into the buffer it reads, so
    a chunk holds one [c, V] tensor instead of two (2 GiB less at 4096 rows of a 262K vocabulary)."""
    return logits.copy_(_softmax_minus_onehot(logits, lse, labels))


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
    """The same against the target's distribution softmax(target_logits [c, V]) (distillation)."""
    lf = logits.float()
    lse = _log_sum_exp(lf)  # [c]
    soft = torch.softmax(target_logits.float(), dim=-1)  # [c, V]
    ce = lse - (soft * lf).sum(-1)
    pred = lf.argmax(dim=-1)
    if not need_grad:
        return ce, pred, None
    return ce, pred, (torch.exp(lf - lse[:, None]) - soft).to(logits.dtype)


def _chunk_fn(hard: bool, compiled: bool):
    """The per-chunk math: the one-hot gradient (hard labels) or the whole soft-target chunk;
    each hard-label form is the one its mode runs fastest."""
    if hard:
        return compiled_once(_softmax_minus_onehot_into_logits) if compiled else _softmax_minus_onehot_eager
    return compiled_once(_soft_target_chunk) if compiled else _soft_target_chunk


def _chunk_ce(logits: torch.Tensor, labels: torch.Tensor | None, target_hidden: torch.Tensor | None,
              w: torch.Tensor, target_softcap: float | None, chunk_fn: Callable, need_grad: bool):
    """(CE [c], argmax [c], dCE/dlogits [c, V] or None) of one chunk's logits [c, V], against its
    labels [c] or, with `target_hidden` [c, H], the target's own (soft-capped) distribution."""
    if target_hidden is None:
        return _hard_label_chunk(logits, labels, need_grad, chunk_fn)
    return chunk_fn(logits, _target_logits(target_hidden, w, target_softcap), need_grad)


# ---- the head's two matmuls around that math -------------------------------------------------

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
    needs each row's incoming weight (grad_ce [M]), known only now, so each chunk's logits are
    computed again: sum over rows of grad_ce * (softmax - target) (x) markov code, in float32."""
    H = w.shape[1]
    tail_w = tail.detach().to(w.dtype)
    grad = torch.zeros(tail.shape, dtype=torch.float32, device=tail.device)  # [V, r]
    for start in range(0, hidden.shape[0], chunk_rows):
        sl = slice(start, start + chunk_rows)
        logits = _head_logits(hidden[sl], w, tail_w)  # [c, V]
        grad_logits = _chunk_ce(logits, None if labels is None else labels[sl],
                                None if target_hidden is None else target_hidden[sl], w, target_softcap,
                                chunk_fn, True)[2]
        scaled = grad_logits.float() * grad_ce[sl, None].float()  # [c, V]
        grad += scaled.T @ hidden[sl, H:].float()  # [V, c] @ [c, r]
        del logits, grad_logits, scaled  # (see _HeadCrossEntropy.forward)
    return grad


# ---- the autograd Function ----------------------------------------------------------------------

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
        # hidden [M, H] or [M, H + r]; weight [V, H]; labels [M] or None; target_hidden [M, H] or None;
        # tail [V, r] or None; row_weights [M], a RowWeigher or None
        rows = hidden.shape[0]
        ce = torch.empty(rows, dtype=torch.float32, device=hidden.device)  # [M]
        pred = torch.empty(rows, dtype=torch.long, device=hidden.device)  # [M]
        grad_hidden = torch.empty_like(hidden) if need_grad else None  # like hidden
        weigh = row_weights if callable(row_weights) else None
        if weigh is not None:  # filled chunk by chunk, from each chunk's CEs
            row_weights = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        w = weight  # frozen, often bf16: cast the small hidden chunks, never the [V, H] matrix
        tail_w = tail.detach().to(w.dtype) if tail is not None else None  # [V, r], small
        train_tail = tail is not None and need_grad and tail.requires_grad
        folded = torch.zeros(tail.shape, dtype=torch.promote_types(tail.dtype, torch.float32), device=tail.device) \
            if train_tail and row_weights is not None else None  # [V, r]: the tail's gradient per unit of the sum
        chunk_fn = _chunk_fn(target_hidden is None, compiled)
        for start in range(0, rows, chunk_rows):
            sl = slice(start, start + chunk_rows)
            logits = _head_logits(hidden[sl], w, tail_w)  # [c, V]
            ce[sl], pred[sl], grad_logits = _chunk_ce(
                logits, None if labels is None else labels[sl], None if target_hidden is None else target_hidden[sl],
                w, target_softcap, chunk_fn, need_grad)
            if weigh is not None:
                row_weights[sl] = weigh(ce[sl], sl)
            if need_grad:
                grad_hidden[sl] = _head_back(grad_logits, w, tail_w).to(hidden.dtype)
            if folded is not None:  # weight each row on the small [c, r] codes, not the [c, V] gradient
                codes = hidden[sl, w.shape[1]:] * row_weights[sl, None].to(hidden.dtype)
                folded += grad_logits.T @ codes.to(grad_logits.dtype)
            # the chunk's [c, V] tensors go before the next chunk's are made: kept until their names
            # were rebound, they would be alive beside the next ones. With the compiled gradient
            # written over the logits, one [c, V] tensor is alive instead of three (at 4096 rows of a
            # 262K vocabulary 2 GiB rather than 6, during the forward, when activations peak too)
            del logits, grad_logits
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
        grad_rows = grad_ce  # [M]: d loss / d ce, from the per-row output and the weighted sum
        if grad_weighted is not None:
            by_weight = grad_weighted * row_weights
            grad_rows = by_weight if grad_rows is None else grad_rows + by_weight
        grad_h = None if grad_rows is None else grad_hidden * grad_rows[:, None].to(grad_hidden.dtype)
        return grad_h, None, None, None, None, None, None, _backward_tail(ctx, grad_ce, grad_weighted), None, None


def _backward_tail(ctx, grad_ce, grad_weighted) -> torch.Tensor | None:
    """The tail's gradient [V, r] in the backward pass (None without a trainable tail): the weighted
    sum's part folded in the forward loop, scaled by its one incoming gradient, plus, when the
    per-row CEs feed the loss too, their part (`_tail_grad`: every chunk once more)."""
    if ctx.tail_args is None:
        return None
    grad_tail = None
    if ctx.folded is not None and grad_weighted is not None:
        grad_tail = ctx.folded * grad_weighted
    if grad_ce is not None:
        by_row = _tail_grad(grad_ce, *ctx.tail_args)
        grad_tail = by_row if grad_tail is None else grad_tail + by_row
    return grad_tail.to(ctx.tail_args[2].dtype) if grad_tail is not None else None


# ---- the entry points ---------------------------------------------------------------------------

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
    group_rows: int = 1,  # rows a RowWeigher reads together (a block's slots): chunks hold whole groups
    target_softcap: float | None = None,  # the target's final_logit_softcapping (distillation)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """head_cross_entropy plus the differentiable sum row_weights @ ce and the weights [M]; a
    loss built on that sum alone trains a tail without computing the logits a second time
    (_HeadCrossEntropy). `row_weights` as a function (RowWeigher) weighs each chunk from its
    own detached CEs as they are computed, a whole group of `group_rows` rows at a time."""
    if callable(row_weights):
        chunk_rows = group_aligned_chunk(chunk_rows, group_rows)
    else:
        row_weights = row_weights.detach()
    return _head_ce(hidden, lm_head_weight, labels, target_hidden, chunk_rows, compiled, tail, row_weights,
                    target_softcap)


# rows of a chunk are kept a multiple of this where groups allow: an odd row count (4095 = 273
# blocks of 15 slots) gets the chunk's two matmuls other cuBLAS kernels than 4096 rows do
MATMUL_ROW_ALIGN = 16


def group_aligned_chunk(chunk_rows: int, group_rows: int) -> int:
    """The largest chunk of at most `chunk_rows` rows holding whole groups of `group_rows`, a multiple
    of MATMUL_ROW_ALIGN too when that still fits (4096 rows in groups of 15: 4080); at least one group."""
    both = math.lcm(group_rows, MATMUL_ROW_ALIGN)
    if chunk_rows >= both:
        return chunk_rows // both * both
    return max(group_rows, chunk_rows // group_rows * group_rows)


def _head_ce(hidden, lm_head_weight, labels, target_hidden, chunk_rows, compiled, tail, row_weights,
             target_softcap=None):
    if (labels is None) == (target_hidden is None):
        raise ValueError("give exactly one of labels and target_hidden")
    if labels is not None:
        labels = labels.clamp(min=0)  # IGNORE slots carry weight 0; any id is fine there
    need_grad = hidden.requires_grad or (tail is not None and tail.requires_grad)
    return _HeadCrossEntropy.apply(hidden, lm_head_weight, labels, target_hidden, chunk_rows,
                                   need_grad, compiled, tail, row_weights, target_softcap)
