"""A linear's weights as the per-token layer functions take them (the packed forward, target/packed.py;
the decoding engines, generate/layers.py): a `Projection` is (weight, bias) in the model's dtype, or
(weight_fp8, weight_scale, bias) for an FP8Linear (target/fp8.py), whose input is quantised once per
token for all the projections that share it (`project`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.target.fp8 import FP8Linear, fp8_matmul, quantize_rows

Projection = tuple  # (weight, bias) in the model's dtype, or (weight_fp8, weight_scale, bias)


def projection_of(module: nn.Module, rows: slice | None = None) -> Projection:
    """A linear's weights as `project` takes them; `rows`: a block of its outputs (of a fused
    projection: Phi-3's qkv_proj, gate_up_proj), as views."""
    fp8 = isinstance(module, FP8Linear)
    if rows is None:
        return (module.weight_fp8, module.weight_scale, module.bias) if fp8 else (module.weight, module.bias)
    bias = module.bias[rows] if module.bias is not None else None
    if fp8:  # one scale per output row
        return (module.weight_fp8[rows], module.row_scale[rows].t(), bias)
    return (module.weight[rows], bias)


def project(h: Tensor, projections: Sequence[Projection]) -> list[Tensor]:
    """F.linear of one input with several projections of one kind: bf16 (weight, bias), or
    float8 (weight_fp8, weight_scale, bias), which quantises `h` once per token for all."""
    if len(projections[0]) == 2:
        return [F.linear(h, w, b) for w, b in projections]
    lead = h.shape[:-1]
    h8, sh = quantize_rows(h.reshape(-1, h.shape[-1]))
    return [fp8_matmul(h8, sh, w8, ws, b, h.dtype).reshape(*lead, w8.shape[0]) for w8, ws, b in projections]


def gated_mlp(h: Tensor, gate_p: Projection, up_p: Projection, down_p: Projection) -> Tensor:
    """down(silu(gate(h)) * up(h)): the SiLU-gated MLP of the Llama family (and of GLM's shared experts)."""
    gate, up = project(h, (gate_p, up_p))
    return project(F.silu(gate) * up, (down_p,))[0]
