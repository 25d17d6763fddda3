"""Anchor selection: which positions start a training block.

Position p is a candidate when document_ids[p] >= 0, p + 1 is in the same document and
loss_mask[p + 1] is set (the block's first label is a token the drafter must learn).
Up to N candidates per row are drawn uniformly without replacement and sorted ascending
(sorted anchors make the attention mask block-sparse).

Two paths with the same distribution:
* dynamic (eager): `nonzero` + `randperm` over the real candidates only;
* fixed-shape (torch.compile / CUDA graphs): one uniform key per position, -1 for
  non-candidates, `topk` of N; no data-dependent shapes, no host sync.

Output layout (both paths): `anchors` LongTensor[R, N] sorted ascending, `valid`
BoolTensor[R, N]; valid slots come first, and invalid slots hold S - 1 so that the row
stays sorted and every index stays in bounds.
"""

from __future__ import annotations

import torch


def anchor_candidates(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """BoolTensor[R, S]: True where p is a valid anchor (spec: "Anchors")."""
    cand = torch.zeros_like(document_ids, dtype=torch.bool)
    cand[:, :-1] = (
        (document_ids[:, :-1] >= 0)
        & (document_ids[:, 1:] == document_ids[:, :-1])
        & loss_mask[:, 1:].bool()
    )
    return cand


def select_anchors(
    loss_mask: torch.Tensor,
    document_ids: torch.Tensor,
    num_anchors: int,
    block_size: int,
    *,
    generator: torch.Generator | None = None,
    fixed_shape: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw up to `num_anchors` sorted anchors per row. Returns (anchors [R, N], valid [R, N]).

    `block_size` is validated only: the candidate rule does not depend on it (a block that
    runs past its document simply has fewer valid labels, see drafter/labels.py).
    """
    if loss_mask.shape != document_ids.shape or loss_mask.dim() != 2:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} and document_ids {tuple(document_ids.shape)} must both be [R, S]")
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    cand = anchor_candidates(loss_mask, document_ids)
    if fixed_shape:
        return _select_fixed_shape(cand, num_anchors, generator)
    return _select_dynamic(cand, num_anchors, generator)


def _select_dynamic(cand: torch.Tensor, n: int, generator: torch.Generator | None):
    R, S = cand.shape
    anchors = torch.full((R, n), S - 1, dtype=torch.long, device=cand.device)
    valid = torch.zeros((R, n), dtype=torch.bool, device=cand.device)
    for r in range(R):
        positions = torch.nonzero(cand[r], as_tuple=True)[0]
        take = min(n, positions.numel())
        if take == 0:
            continue
        order = torch.randperm(positions.numel(), generator=generator, device=_gen_device(generator, cand))
        chosen = positions[order[:take].to(cand.device)]
        anchors[r, :take] = torch.sort(chosen).values
        valid[r, :take] = True
    return anchors, valid


def _select_fixed_shape(cand: torch.Tensor, n: int, generator: torch.Generator | None):
    R, S = cand.shape
    keys = torch.rand((R, S), generator=generator, device=_gen_device(generator, cand)).to(cand.device)
    keys = torch.where(cand, keys, torch.full_like(keys, -1.0))
    k = min(n, S)
    top, idx = torch.topk(keys, k, dim=1)  # the k largest keys: a uniform subset of candidates
    valid = top >= 0
    # Sort valid anchors ascending and push invalid slots to the end as S - 1.
    idx = torch.where(valid, idx, torch.full_like(idx, S - 1))
    anchors, order = torch.sort(idx, dim=1, stable=True)
    valid = torch.gather(valid, 1, order)
    # A valid anchor at S-1 cannot exist (p+1 must be in the row), so after the sort every
    # invalid slot sits after every valid one. Pad to n when the row is shorter than n.
    if k < n:
        anchors = torch.cat([anchors, anchors.new_full((R, n - k), S - 1)], dim=1)
        valid = torch.cat([valid, valid.new_zeros((R, n - k))], dim=1)
    return anchors, valid


def _gen_device(generator: torch.Generator | None, like: torch.Tensor) -> torch.device:
    return generator.device if generator is not None else like.device


def trim_anchor_columns(anchors: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager mode only: drop trailing columns that are invalid in every row.

    A batch with few candidates then runs N' < N blocks instead of padding to N. Costs one
    host sync, which is why the compiled (fixed-shape) path never calls it.
    """
    used = int(valid.sum(dim=1).max().item()) if valid.numel() else 0
    used = max(used, 1)
    return anchors[:, :used], valid[:, :used]
