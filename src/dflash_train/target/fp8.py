"""Optional FP8 target forward (`target.fp8: true`): the frozen target's decoder linears
run as float8 e4m3 matmuls on Hopper (`torch._scaled_mm`).

Weights are quantised once with one scale per output channel; activations are quantised
per token at run time. Embedding, norms, attention and the LM head stay in bf16. The
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


class FP8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        w8, scale = quantize_rows(linear.weight.detach())  # [N, K], [N, 1]
        self.register_buffer("weight_fp8", w8)
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, N]
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x8, sx = quantize_rows(x.reshape(-1, self.in_features))
        if x.is_cuda:
            y = torch._scaled_mm(x8, self.weight_fp8.t(), scale_a=sx, scale_b=self.weight_scale,
                                 bias=self.bias, out_dtype=x.dtype, use_fast_accum=True)
        else:  # emulation with the same quantised values
            y = (x8.float() * sx) @ (self.weight_fp8.float() * self.weight_scale.t()).t()
            if self.bias is not None:
                y = y + self.bias.float()
            y = y.to(x.dtype)
        return y.reshape(*lead, self.out_features)


def convert_decoder_linears(model: nn.Module, layers: nn.ModuleList) -> int:
    """Replace every nn.Linear inside the decoder layers by FP8Linear; returns how many."""
    count = 0
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, FP8Linear(child))
                    count += 1
    if next(model.parameters()).is_cuda:
        torch.cuda.empty_cache()
    return count
