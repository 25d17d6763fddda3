"""The dspark variant's bigram head (docs/dflash-spec.md, "Variant: dspark").

The DFlash backbone drafts every slot of a block at once; this head adds back a first-order
dependency inside the block. The logits of slot k are

    lm_head(h_k) + markov_w2 @ markov_w1[x_{k-1}]         (markov_w1, markov_w2: [V, r])

where x_{k-1} is the token before slot k: the anchor for k = 1, then the token drafted (at
inference) or taught (in training) for slot k - 1. The gated head (DSpark's "gated") scales
that code per slot by the slot's hidden state:

    code_k = sigmoid(gate_proj([h_k ; e])) * e,   e = markov_w1[x_{k-1}]

(gate_proj [r, H + r]), so the bias of a previous token depends on the context. Both parts are
one matmul over the concatenation [h_k ; code_k] against [lm_head | markov_w2]: the loss
(drafter/loss.py) takes the wider hidden state and markov_w2 as a trainable tail of the head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.drafter.labels import block_label_positions


class MarkovHead(nn.Module):
    """markov_w1: token -> r-dim code; markov_w2: code -> a bias over the vocabulary; gated:
    gate_proj, [h ; code] -> the code's per-slot gate. The names are the tensors' names in the
    exported checkpoint (`markov_head.markov_w{1,2}.weight`, `markov_head.gate_proj.{weight,bias}`)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str = "vanilla"):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # weight [V, r]
        self.gate_proj = nn.Linear(hidden_size + rank, rank) if head_type == "gated" else None  # [r, H + r]

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        self.markov_w1.weight.normal_(0.0, std)
        self.markov_w2.weight.normal_(0.0, std)
        if self.gate_proj is not None:  # every gate starts at sigmoid(~0) = 1/2
            self.gate_proj.weight.normal_(0.0, std)
            self.gate_proj.bias.zero_()

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(markov_w1, markov_w2, gate weight or None, gate bias or None): `markov_drafts`' arguments."""
        gate = self.gate_proj
        return (self.markov_w1.weight, self.markov_w2.weight,
                None if gate is None else gate.weight, None if gate is None else gate.bias)

    def widen(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., H] hidden states, [...] previous tokens -> [..., H + r] = [h ; code]."""
        code = self.markov_w1(prev_ids).to(hidden.dtype)
        if self.gate_proj is not None:
            code = torch.sigmoid(self.gate_proj(torch.cat([hidden, code], dim=-1))) * code
        return torch.cat([hidden, code], dim=-1)


def markov_bias(prev_ids: torch.Tensor, markov_w1: torch.Tensor, markov_w2: torch.Tensor,
                gate_code_w: torch.Tensor | None = None, gate_from_hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[...] previous tokens -> [..., V] logit bias markov_w2 @ code (weights [V, r], in the
    logits' dtype; inference, one slot at a time): code = markov_w1[prev], gated when
    `gate_code_w` (the gate's code part, [r, r]) is given by sigmoid(`gate_from_hidden` (the
    slot's hidden part of the gate with its bias, [..., r]) + code @ gate_code_w.T). Plain
    tensors, so that the engine's compiled head can take them."""
    code = F.embedding(prev_ids, markov_w1).to(markov_w2.dtype)
    if gate_code_w is not None:
        code = torch.sigmoid(gate_from_hidden + code @ gate_code_w.T) * code
    return code @ markov_w2.T


def previous_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor,
                    label_valid: torch.Tensor) -> torch.Tensor:
    """Teacher-forced previous token of every slot: [R, N, B] (slot 0's entry is unused).

    Slot k's previous token is the label of slot k - 1 where that label is valid (the token the
    target commits there, whatever the label source), else the dataset token at a_j + k - 1;
    for k = 1 that is the anchor token itself. input_ids [R, S], anchors [R, N],
    labels/label_valid [R, N, B]."""
    R, S = input_ids.shape
    B = labels.shape[-1]
    pos = (block_label_positions(anchors, B) - 1).clamp(0, S - 1)  # a_j + k - 1: [R, N, B]
    data = torch.gather(input_ids, 1, pos.view(R, -1)).view_as(pos)
    shifted_labels = torch.cat([labels[..., :1], labels[..., :-1]], dim=-1)  # label of slot k - 1
    shifted_valid = torch.cat([torch.zeros_like(label_valid[..., :1]), label_valid[..., :-1]], dim=-1)
    return torch.where(shifted_valid, shifted_labels, data)


@torch.no_grad()
def markov_drafts(hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head_weight: torch.Tensor,
                  markov_w1: torch.Tensor, markov_w2: torch.Tensor, gate_w: torch.Tensor | None = None,
                  gate_b: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy drafts of slots 1..B-1, left to right: hidden [S, B-1, H] (final normed states of
    slots 1..B-1), anchor_ids [S], the head's weights (MarkovHead.weights) -> drafts [S, B-1]. The
    backbone logits of all slots come from one matmul, and so do the hidden state's part of the
    gates; only the bias ([S, r] -> [S, V] per slot) runs sequentially. Plain tensors: the engine
    compiles this as one function (its `dspark_head`)."""
    base = hidden.to(lm_head_weight.dtype) @ lm_head_weight.T  # [S, B-1, V]
    # cast once, not once a slot (no-ops when the drafter runs in bf16)
    markov_w2 = markov_w2.to(base.dtype)
    gates = gate_code_w = None
    if gate_w is not None:  # the gate's hidden part for every slot at once: [S, B-1, r]
        H = hidden.shape[-1]
        gates = torch.addmm(gate_b.to(base.dtype), hidden.to(base.dtype).flatten(0, 1),
                            gate_w[:, :H].to(base.dtype).T).view(*hidden.shape[:2], -1)
        gate_code_w = gate_w[:, H:].to(base.dtype)
    prev = anchor_ids
    drafts = []
    for k in range(base.shape[1]):
        bias = markov_bias(prev, markov_w1, markov_w2, gate_code_w, None if gates is None else gates[:, k])
        prev = (base[:, k] + bias).argmax(-1)  # [S]
        drafts.append(prev)
    return torch.stack(drafts, dim=1)
