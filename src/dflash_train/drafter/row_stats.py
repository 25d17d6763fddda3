"""Per-row statistics of a [rows, vocab] block of logits in one read: the log-sum-exp, the
label's logit and the argmax. The LM head's cross-entropy (drafter/head_kernel.py) needs all three
for every chunk of logits it makes.

Each row is read in blocks of `BLOCK` columns, keeping three running numbers per row: the max
m, the sum s of exp(x - m) (rescaled by exp(m_old - m_new) when a block raises the max) and
the argmax. Within a block the argmax is the first index of the block's max; a later block
takes over only with a strictly larger max, so the result is the first index of the row's max,
as torch.argmax gives it. A NaN logit makes s, and so the log-sum-exp and the loss, NaN (the
trainer then skips the step). The label's logit is one load per row.

GPU (CUDA, with Triton): one Triton program per row. Compiled by Inductor, the same statistics
(an online-softmax reduction with an argmax) ran at about 1 TB/s at the qwen3-8b shape (4096 x
151,936 bf16: 1.3 ms for a 1.24 GB read) under every option tried (bench/ce_chunk_kernels.py).
CPU (or no Triton): the same blocks in torch ops; the tests check it against the definitions.
"""

from __future__ import annotations

import torch

try:  # the GPU path; CPU-only installs have no Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 4096  # columns per step of a row; a power of two (Triton's block shapes must be)
NUM_WARPS = 8


def row_stats(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [rows, V] (any float dtype, read as float32), labels [rows] in [0, V) ->
    (log-sum-exp [rows] float32, the label's logit [rows] float32, argmax [rows] int64)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"row_stats needs logits [rows, V] and labels [rows], got {tuple(logits.shape)} "
                         f"and {tuple(labels.shape)}")
    if logits.is_cuda and triton is not None:
        return _row_stats_triton(logits, labels)
    return _row_stats_blocks(logits, labels)


def _row_stats_blocks(logits: torch.Tensor, labels: torch.Tensor):
    """The algorithm in torch ops, all rows at once, one block of columns at a time."""
    rows, V = logits.shape
    m = torch.full((rows,), float("-inf"), dtype=torch.float32, device=logits.device)
    s = torch.zeros(rows, dtype=torch.float32, device=logits.device)
    arg = torch.zeros(rows, dtype=torch.int64, device=logits.device)
    for start in range(0, V, BLOCK):
        x = logits[:, start:start + BLOCK].float()
        block_max, block_arg = x.max(dim=1).values, x.argmax(dim=1)
        new_m = torch.maximum(m, block_max)
        s = s * torch.exp(m - new_m) + torch.exp(x - new_m[:, None]).sum(dim=1)
        arg = torch.where(block_max > m, start + block_arg, arg)
        m = new_m
    label_logit = logits.gather(1, labels[:, None]).squeeze(1).float()
    return m + s.log(), label_logit, arg


if triton is not None:

    @triton.jit
    def _row_stats_kernel(x_ptr, labels_ptr, lse_ptr, label_logit_ptr, arg_ptr, V, stride_row,
                          BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_row
        cols = tl.arange(0, BLOCK)
        m = tl.full((), float("-inf"), tl.float32)
        s = tl.zeros((), tl.float32)
        arg = tl.zeros((), tl.int64)
        for start in range(0, V, BLOCK):
            idx = start + cols
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            block_max, block_arg = tl.max(x, 0, return_indices=True, return_indices_tie_break_left=True)
            new_m = tl.maximum(m, block_max)
            s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), 0)
            arg = tl.where(block_max > m, (start + block_arg).to(tl.int64), arg)
            m = new_m
        tl.store(lse_ptr + row, m + tl.log(s))
        label = tl.load(labels_ptr + row)
        tl.store(label_logit_ptr + row, tl.load(base + label).to(tl.float32))
        tl.store(arg_ptr + row, arg)


def _row_stats_triton(logits: torch.Tensor, labels: torch.Tensor, block: int = BLOCK, num_warps: int = NUM_WARPS):
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    rows, V = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    label_logit = torch.empty_like(lse)
    arg = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _row_stats_kernel[(rows,)](logits, labels.contiguous(), lse, label_logit, arg, V, logits.stride(0),
                                   BLOCK=block, num_warps=num_warps)
    return lse, label_logit, arg
