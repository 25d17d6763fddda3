"""Block labels: what slot k of the block at anchor a_j must predict.

Slot k >= 1 predicts the token at a_j + k (no shift). The label is valid only if
a_j + k < S, that position is in the anchor's document and its loss_mask is set; slot 0
(the anchor itself) is never a label. A label never comes from the next document of a
packed row.

Label sources:
* `data`:   the dataset token at a_j + k                      (`build_block_labels`)
* `target`: argmax of the target logits at a_j + k - 1        (`target_block_labels`)
* `distill`: the target distribution at a_j + k - 1: its final hidden states there
            (`gather_target_states`), turned into logits chunk by chunk in drafter/head_kernel.py
Target logits are computed only at the distinct positions a_j .. a_j + B - 2 of valid
labels, never for the whole sequence and vocabulary.
"""

from __future__ import annotations

import torch

from dflash_train.target.ops import soft_cap
from dflash_train.utils.device import HostCopy

IGNORE = -100  # invalid label slots hold this so that any accidental use fails loudly


def block_label_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """[R, N] anchors -> [R, N, B] positions a_j + k (may exceed S - 1; see validity)."""
    return anchors[..., None] + torch.arange(block_size, device=anchors.device)


def block_label_validity(
    document_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(label_valid [R, N, B], clamped positions [R, N, B]) per the spec's label rule."""
    R, S = document_ids.shape
    pos = block_label_positions(anchors, block_size)
    in_row = pos < S
    pos_c = pos.clamp(max=S - 1)
    flat = pos_c.view(R, -1)
    doc_at = torch.gather(document_ids, 1, flat).view_as(pos)
    loss_at = torch.gather(loss_mask.bool(), 1, flat).view_as(pos)
    anchor_doc = torch.gather(document_ids, 1, anchors)[..., None]
    not_slot0 = torch.arange(block_size, device=anchors.device) >= 1
    label_valid = valid[..., None] & in_row & (doc_at == anchor_doc) & loss_at & not_slot0
    return label_valid, pos_c


def build_block_labels(
    input_ids: torch.Tensor,
    document_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`data` labels: (labels LongTensor[R, N, B], label_valid BoolTensor[R, N, B]).

    Invalid slots hold IGNORE (-100).
    """
    R = input_ids.shape[0]
    label_valid, pos_c = block_label_validity(document_ids, loss_mask, anchors, valid, block_size)
    labels = torch.gather(input_ids, 1, pos_c.view(R, -1)).view_as(pos_c)
    return torch.where(label_valid, labels, torch.full_like(labels, IGNORE)), label_valid


def predecessor_positions(anchors: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """Positions whose target logits give slot k's label: a_j + k - 1 for k = 1..B-1.

    Returns [R, N, B-1], clamped into the row (clamped entries belong to invalid labels).
    """
    k = torch.arange(1, block_size, device=anchors.device)
    return (anchors[..., None] + k - 1).clamp(max=seq_len - 1)


def gather_target_states(final_hidden: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Target final-normed hidden states at a_j + k - 1: [R, S, H] -> [R, N, B-1, H]."""
    R, S, H = final_hidden.shape
    pos = predecessor_positions(anchors, block_size, S)
    gathered = torch.gather(final_hidden, 1, pos.view(R, -1, 1).expand(-1, -1, H))
    return gathered.view(R, *pos.shape[1:], H)


def needed_label_rows(pred: torch.Tensor, label_valid: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[R * S] uint8: 1 at the flat positions (r * S + p) among `pred` [R, N, B-1]
    (`predecessor_positions`) whose target logits some valid label needs. Blocks of nearby
    anchors overlap (512 random anchors of 16 slots in 8192 tokens need 4,500-5,300 distinct
    positions, not 7,680), so each position's logits are computed once."""
    R = pred.shape[0]
    flat = (pred + seq_len * torch.arange(R, device=pred.device)[:, None, None]).reshape(-1)
    needed = torch.zeros(R * seq_len, dtype=torch.uint8, device=pred.device)
    return needed.scatter_reduce_(0, flat, label_valid[..., 1:].reshape(-1).to(torch.uint8), "amax")


class PendingTargetLabels:
    """`target` labels in two halves, so that their one host read never drains the GPU.

    The number of distinct rows is data-dependent and the host must know it to size the LM-head
    matmul. The constructor queues the validity rule and that count and starts copying the count
    back (`HostCopy`); `finish()` computes the labels. Called with the drafter forward queued in
    between, the host waits only for the count (the target forward) while the GPU has the drafter
    to run, and the label kernels queue behind it instead of after an idle gap."""

    def __init__(self, document_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                 valid: torch.Tensor, block_size: int):
        R, S = document_ids.shape
        self.anchors, self.block_size = anchors, block_size
        self.label_valid, _ = block_label_validity(document_ids, loss_mask, anchors, valid, block_size)
        self.pred = predecessor_positions(anchors, block_size, S)  # [R, N, B-1]
        self.needed = needed_label_rows(self.pred, self.label_valid, S)  # [R * S]
        self.count = HostCopy(self.needed.sum())

    @torch.no_grad()
    def finish(self, final_hidden: torch.Tensor, lm_head_weight: torch.Tensor, *, chunk_rows: int = 8192,
               logit_softcap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(labels [R, N, B], label_valid [R, N, B]): the target's greedy token per valid slot.
        `final_hidden` [R, S, H]: the target states after its final norm; `lm_head_weight` [V, H];
        `logit_softcap`: the target's final_logit_softcapping. tanh keeps the order of the logits, but
        in bf16 it can round two near the cap to one value, and the target's greedy choice is made
        on the capped logits: so are the labels."""
        R, S, H = final_hidden.shape
        rows = torch.nonzero_static(self.needed, size=int(self.count.get())).squeeze(1)  # [U], no sync
        states = final_hidden.reshape(R * S, H)[rows]  # [U, H]
        w = lm_head_weight.to(states.dtype)
        greedy_at = torch.zeros(R * S, dtype=torch.long, device=states.device)  # per flat position
        for start in range(0, rows.numel(), chunk_rows):
            chunk = slice(start, start + chunk_rows)
            greedy_at[rows[chunk]] = soft_cap(states[chunk] @ w.T, logit_softcap).argmax(dim=-1)
        labels = torch.full((*self.anchors.shape, self.block_size), IGNORE, dtype=torch.long, device=self.anchors.device)
        labels[:, :, 1:] = torch.gather(greedy_at.view(R, S), 1, self.pred.view(R, -1)).view_as(self.pred)
        return torch.where(self.label_valid, labels, torch.full_like(labels, IGNORE)), self.label_valid


def target_block_labels(
    final_hidden: torch.Tensor,  # [R, S, H] target hidden states after its final norm
    lm_head_weight: torch.Tensor,  # [V, H]
    document_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    *,
    chunk_rows: int = 8192,
    logit_softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`target` labels: the target's greedy token for each slot, same validity as `data`.

    Logits are computed only at the distinct predecessor positions of valid labels
    (`needed_label_rows`), in chunks, so the [positions, V] matrix never exists at once.
    """
    pending = PendingTargetLabels(document_ids, loss_mask, anchors, valid, block_size)
    return pending.finish(final_hidden, lm_head_weight, chunk_rows=chunk_rows, logit_softcap=logit_softcap)
