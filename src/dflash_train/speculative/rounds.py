"""One round of the speculative engine (speculative/engine.py): its commit on the device and
its report on the host.

`commit_round` is the end of the verify step: greedy acceptance of the drafts and the commit,
in place on the slots' device state, and the round's report written for the host. `Row` is
the host's record of the sequence in a slot, `Launched` a round on its way back to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflash_train.generate.continuous_batching import DeviceMarks, wait_for
from dflash_train.speculative.loop import Round


@dataclass(eq=False)
class Row:
    """Host record of the sequence in a slot."""

    index: int  # in the caller's prompt list
    prompt_len: int
    limit: int  # max_new_tokens
    position: int  # of the last committed token (as read back so far)
    t_start: float
    prefill: DeviceMarks  # its device time, read with the first round
    greedy: bool
    first_pending: bool = True  # the prefill's token is read back with the row's first round
    in_flight: int = 0  # rounds launched for this row and not read back yet
    prefill_seconds: float = 0.0
    out: list[int] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    top_logits: list[float] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def needs_round(self) -> bool:
        """Whether a new round can still commit for this row. Each round in flight commits at
        least one token while the row is active, so once the tokens known plus the rounds in
        flight reach the limit, those rounds finish it. A row whose first token is unread
        needs one round to bring it back."""
        if self.first_pending and not self.in_flight:
            return True
        return len(self.out) + self.first_pending + self.in_flight < self.limit


@dataclass
class Launched:
    """A round on its way: the rows it reports for, and where its report lands."""

    rows: list[tuple[int, Row]]  # (slot, row) as at the launch
    report: Tensor  # host copy of the report [slots, B + 4] (pinned on CUDA)
    top2: Tensor | None  # host copy of top2 [slots, 4] (plain greedy only)
    event: object | None  # CUDA event after the copies; None on CPU
    marks: DeviceMarks

    def read(self) -> tuple[list[list[int]], list[list[float]] | None]:
        wait_for(self.event)  # this round alone
        return self.report.tolist(), (self.top2.tolist() if self.top2 is not None else None)


def commit_round(
    logits: Tensor, drafts: Tensor, tokens: Tensor, positions: Tensor, n_out: Tensor, limit: Tensor, active: Tensor,
    block_start: Tensor, stop_table: Tensor, columns: Tensor, report: Tensor, top2: Tensor, *, width: int,
) -> None:  # fmt: skip
    """Greedy acceptance of a verified block and the commit, in place on the engine's state
    (speculative/engine.py). logits [S, T, V] of the block [last token, drafts[:, :T-1]] (T = `width`).
    One function so that torch.compile fuses its few dozen tiny ops into a few kernels.
    report [S, B + 4]: the target's choices, the round's input token (a new row's first
    token comes back this way), committed, accepted, drafted; top2 [S, 4]: this token's top-1
    logit and margin (plain greedy), then the prefill's (written there)."""
    greedy = logits.argmax(-1)  # [S, T]: greedy[:, k] is the target's choice after input k
    report[:, -4].copy_(tokens)
    if width > 1:
        block_start.copy_(positions)  # the taps just written start here: the drafter's next context
        drafted = (limit - n_out - 1).clamp(0, width - 1)  # never draft past max_new_tokens
        match = (drafts == greedy[:, :-1]).long().cumprod(1).sum(1)
        accepted = torch.minimum(match, drafted)
    else:
        drafted = accepted = torch.zeros_like(n_out)
        top = logits[:, 0].float().topk(2, dim=-1).values  # [S, 2]
        top2[:, :2].copy_(torch.stack([top[:, 0], top[:, 0] - top[:, 1]], 1))
    # The accepted drafts equal greedy[:, :a], so the commit is greedy[:, :a + 1], cut after a stop token.
    candidate = accepted + 1
    is_stop = (greedy[..., None] == stop_table).any(-1) & (columns[None, :width] < candidate[:, None])
    stopped = is_stop.any(1)
    first_stop = torch.where(stopped, is_stop.long().argmax(1), width)
    committed = torch.minimum(candidate, first_stop + 1) * active
    n_out.add_(committed)
    last = greedy.gather(1, (committed - 1).clamp(min=0)[:, None])[:, 0]
    tokens.copy_(torch.where(committed > 0, last, tokens))
    active.logical_and_(~(stopped | (n_out >= limit)))
    # Finished slots keep stepping (on stale input, committing nothing) until refilled, at
    # position 0: in range, and every query of theirs sees at least its own block.
    positions.add_(committed).mul_(active)
    report[:, :width].copy_(greedy)
    report[:, -3:].copy_(torch.stack([committed, accepted, drafted], 1))
