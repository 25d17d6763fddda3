"""Optional FP8 target forward (`target.fp8: true`): the frozen target's decoder linears
run as float8 e4m3 matmuls on Hopper (`torch._scaled_mm`).

Weights are quantised once with one scale per output channel; activations are quantised
per token at run time. Embedding, norms, attention and the LM head stay in bf16. With the
Hugging Face forward each `FP8Linear` quantises its input in eager kernels of its own (the
unfused path, slower than bf16 on an H200); the packed forward (target/packed.py) calls
`quantize_rows` / `fp8_matmul` inside its per-layer functions, once per shared input, so
under `target.compile` the quantisation fuses into the norm / activation kernels before it. The
drafter then learns from slightly perturbed hidden states; docs/performance.md reports
the perturbation and the speed. On a CPU the same quantised numbers are multiplied in
float32 (slow; for tests only).
"""

from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale [M, 1] float32) with x ~= x_fp8 * scale."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def fp8_matmul(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """(x8 * sx) @ (w8 * w_scale).T (+ bias) in `out_dtype`, for x8 [M, K], sx [M, 1], w8 [N, K],
    w_scale [1, N]: float8 tensor cores with row-wise scales on CUDA (`torch._scaled_mm`);
    elsewhere the same quantised numbers multiplied in float32 (the hardware forces the
    difference: CPUs have no float8 matmul; this branch is the reference the tests check)."""
    if x8.is_cuda:
        return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=w_scale, bias=bias, out_dtype=out_dtype,
                                use_fast_accum=True)
    y = (x8.float() * sx) @ (w8.float() * w_scale.t()).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_linear(x: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with float8 operands: x [..., K] quantised per token, then `fp8_matmul`.
    Under torch.compile the quantisation fuses into the kernel that produced x."""
    lead = x.shape[:-1]
    x8, sx = quantize_rows(x.reshape(-1, x.shape[-1]))
    return fp8_matmul(x8, sx, w8, w_scale, bias, x.dtype).reshape(*lead, w8.shape[0])


class FP8Linear(nn.Module):
    """A frozen nn.Linear as float8 weights and one scale per output channel. Both are (frozen)
    parameters laid out by output channel, [N, K] and [N, 1], so that a target sharded by rows
    (target/sharded.py) shards them alike and each rank quantises only its rows (`fill_rows`)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w8, scale = quantize_rows(linear.weight.detach())  # [N, K], [N, 1]
        self.weight_fp8 = nn.Parameter(w8, requires_grad=False)
        self.row_scale = nn.Parameter(scale, requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight_scale(self) -> torch.Tensor:
        """[1, N]: the layout `fp8_matmul` takes."""
        return self.row_scale.t()

    @staticmethod
    def fill_rows(weight_fp8: torch.Tensor, row_scale: torch.Tensor, weight_rows: torch.Tensor) -> None:
        """Quantise some rows of the original weight into these (local) tensors: per output
        channel, so any split of the rows gives the whole weight's numbers."""
        w8, scale = quantize_rows(weight_rows)
        weight_fp8.copy_(w8)
        row_scale.copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight_fp8, self.weight_scale, self.bias)


def convert_decoder_linears(model: nn.Module, layers: nn.ModuleList) -> int:
    """Replace every nn.Linear inside the decoder layers by FP8Linear; returns how many."""
    count = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, FP8Linear(child))
                    count += 1
    if next(model.parameters()).is_cuda:  # the bf16 weights just freed
        torch.cuda.empty_cache()
    return count
