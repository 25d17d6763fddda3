"""A linear's weights as the per-token layer functions take them (the packed forward, target/packed.py;
the decoding engines, generate/layers.py): a `Projection` is (weight, bias) in the model's dtype, or
(weight_fp8, weight_scale, bias) for an FP8Linear (target/fp8.py), whose input is quantised once per
token for all the projections that share it (`project`). Plain projections of one input (q, k and
v; an MLP's gate and up) can be one projection (`fused_projection`): one matmul for all of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
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


def fused_projection(parts: Sequence[tuple[nn.Module, slice | None]]) -> Projection | None:
    """One (weight, bias) for projections of one input, given as (linear, its output rows; None:
    all), so that one matmul computes them all, their outputs in order along the last dim: a fused
    module's own weights (Phi-3's qkv_proj, gate_up_proj), or plain linears' weights copied as the
    row blocks of one tensor, which each linear's parameters then view (no second copy is kept; the
    model's own forward reads the same values). None where they cannot be one: float8 or sharded
    weights, weights that train, mixed dtypes, devices or biases."""
    modules = [m for m, _ in parts]
    if not all(_frozen_plain(m) for m in modules):
        return None
    if len(parts) == 1:
        return projection_of(*parts[0])
    if all(m is modules[0] for m in modules):  # the row blocks of one fused module, in order
        ends = [(rows.start, rows.stop) for _, rows in parts if rows is not None]
        whole = len(ends) == len(parts) and ends[0][0] == 0 and ends[-1][1] == modules[0].out_features and \
            all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
        return projection_of(modules[0]) if whole else None
    if any(rows is not None for _, rows in parts) or len({(m.weight.dtype, m.weight.device, m.in_features,
                                                           m.bias is None) for m in modules}) != 1:
        return None
    weights = [m.weight.detach() for m in modules]
    biases = [m.bias.detach() for m in modules] if modules[0].bias is not None else None
    viewed = _consecutive_rows(weights), (_consecutive_rows(biases) if biases is not None else None)
    if viewed[0] is not None and (biases is None or viewed[1] is not None):  # fused before: the same tensors
        return viewed
    weight = torch.cat(weights)
    bias = torch.cat(biases) if biases is not None else None
    start = 0
    for m in modules:  # each linear now views its rows of the fused tensors
        end = start + m.out_features
        m.weight = nn.Parameter(weight[start:end], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return weight, bias


def fused_or_each(parts: Sequence[tuple[nn.Module, slice | None]]) -> tuple[Projection | None, ...]:
    """The projections of one input as the layer functions take them: the fused one, then None for
    each other (`project_fused`), where `fused_projection` can make one; else each its own."""
    fused = fused_projection(parts)
    return (fused, *[None] * (len(parts) - 1)) if fused is not None else tuple(projection_of(*p) for p in parts)


def _consecutive_rows(tensors: Sequence[Tensor]) -> Tensor | None:
    """The one tensor whose consecutive row blocks `tensors` are (as `fused_projection` leaves them), or None."""
    first = tensors[0]
    if not all(t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and t.is_contiguous()
               for t in tensors):
        return None
    if any(b.storage_offset() != a.storage_offset() + a.numel() for a, b in zip(tensors, tensors[1:])):
        return None
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _frozen_plain(m: nn.Module) -> bool:
    """An nn.Linear whose parameters are plain tensors (not sharded, not on the meta device) that do not train."""
    return type(m) is nn.Linear and all(type(p.data) is torch.Tensor and not p.is_meta and not p.requires_grad
                                        for p in m.parameters(recurse=False))


def project_fused(h: Tensor, projections: Sequence[Projection | None], widths: Sequence[int]) -> list[Tensor]:
    """`project` of projections of one input; where all but the first are None, the first is them
    all fused (`fused_projection`), and its output is split into their `widths` (views)."""
    if projections[1] is None:
        return list(project(h, projections[:1])[0].split(list(widths), dim=-1))
    return project(h, projections)


def project(h: Tensor, projections: Sequence[Projection]) -> list[Tensor]:
    """F.linear of one input with several projections of one kind: bf16 (weight, bias), or
    float8 (weight_fp8, weight_scale, bias), which quantises `h` once per token for all."""
    if len(projections[0]) == 2:
        return [F.linear(h, w, b) for w, b in projections]
    lead = h.shape[:-1]
    h8, sh = quantize_rows(h.reshape(-1, h.shape[-1]))
    return [fp8_matmul(h8, sh, w8, ws, b, h.dtype).reshape(*lead, w8.shape[0]) for w8, ws, b in projections]


def gate_and_up(h: Tensor, gate_p: Projection, up_p: Projection | None) -> tuple[Tensor, Tensor]:
    """A gated MLP's gate(h) and up(h); `up_p` None: `gate_p` is both fused, the gate's rows first."""
    if up_p is None:
        return project(h, (gate_p,))[0].chunk(2, dim=-1)
    return project(h, (gate_p, up_p))


def gated_mlp(h: Tensor, gate_p: Projection, up_p: Projection | None, down_p: Projection) -> Tensor:
    """down(silu(gate(h)) * up(h)): the SiLU-gated MLP of the Llama family (and of GLM's shared
    experts). `up_p` None: `gate_p` is gate and up fused (`fused_projection`)."""
    gate, up = gate_and_up(h, gate_p, up_p)
    return project(F.silu(gate) * up, (down_p,))[0]
