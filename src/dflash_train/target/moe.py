"""Mixture-of-experts MLPs for the packed target forward and the decoding engines (Qwen3-MoE,
Mixtral, GLM-4.5, gpt-oss): route each token to its top-k experts, run every expert on its tokens as one
grouped matrix multiply, add the results back weighted by the router.

    route           h [N, H] -> weights [N, k], experts [N, k]   (softmax over E, top-k, renormalised;
                    GLM-4.5: sigmoid scores, chosen with a bias among the best groups, route_sigmoid)
    expert_mlps     token-slot pairs sorted by expert (a fixed N*k rows), each expert's rows one group:
                    gate/up = grouped_mm(x, W_gu[e]) ; y = grouped_mm(silu(gate) * up, W_d[e])
                    out[token] = sum over its k rows of weight * y (rows put back in token order)

Every shape is fixed by N, k and E (the counts per expert are values, not shapes), so the
whole block compiles with the rest of the layer. `grouped_mm` is PyTorch's grouped GEMM (one
kernel for all experts on Hopper; a loop inside PyTorch on the CPU), with the experts' weights
as transformers stores them: gate_up [E, 2I, H], down [E, H, I].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.target.fp8 import FP8Linear

_NATIVE_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# PyTorch's CPU grouped GEMM exists from 2.9 and wants 16-byte aligned inputs before 2.11
_CPU_GROUPED_MM = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)


def grouped_mm(x: Tensor, w: Tensor, *, offs: Tensor) -> Tensor:
    """x [M, in] with rows grouped by expert (group e ends at offs[e]), w [E, in, out] -> [M, out].
    PyTorch's grouped GEMM where it has one for this device and the layout suits it; else one
    matmul per expert (a host sync for the offsets: older CPU builds, odd widths)."""
    # Compiled, the grouped GEMM takes bfloat16 only (Inductor has no other lowering for it); any
    # other dtype runs as one opaque call, since tracing the per-expert loop's data-dependent
    # slices fails on some torch versions (2.11: "Could not guard on data-dependent expression").
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:
        return torch.ops.dflash_train.grouped_mm_opaque(x, w, offs)
    return _grouped_mm_eager(x, w, offs)


def _grouped_mm_eager(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    native = x.is_cuda or _CPU_GROUPED_MM
    if _NATIVE_GROUPED_MM is not None and native and _aligned(x) and _aligned(w):
        return _NATIVE_GROUPED_MM(x, w, offs=offs)
    return expert_loop_mm(x, w, offs)


@torch.library.custom_op("dflash_train::grouped_mm_opaque", mutates_args=())
def _grouped_mm_opaque(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return _grouped_mm_eager(x, w, offs)


@_grouped_mm_opaque.register_fake
def _(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    return x.new_empty(x.shape[0], w.shape[-1])


def grouped_mm_syncs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `grouped_mm` reads the group offsets on the host for this dtype and device: every
    path but PyTorch's bfloat16 kernel on a Hopper-or-newer GPU (its fallback for other dtypes
    and older GPUs loops over the groups on the host, as `expert_loop_mm` does). A step that
    runs such a grouped GEMM cannot be captured in a CUDA graph."""
    if device.type != "cuda" or _NATIVE_GROUPED_MM is None:
        return True
    return dtype != torch.bfloat16 or torch.cuda.get_device_capability(device)[0] < 9


def _aligned(t: Tensor) -> bool:
    """The grouped GEMM's layout rule: every stride but a unit one spans a multiple of 16 bytes."""
    return all(stride == 1 or stride * t.element_size() % 16 == 0 for stride in t.stride())


def expert_loop_mm(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def experts_as_tensors(mlp: nn.Module) -> bool:
    """Whether a layer's mixture is laid out as these functions take it (transformers 5's
    Qwen3-MoE, Mixtral and GLM-4.5): a router `gate` with top_k, experts as 3D gate_up_proj and
    down_proj tensors; GLM's sigmoid router with its score correction bias and groups, and its
    shared experts, a gated MLP (of plain or FP8 linears). Qwen2-MoE's gated `shared_expert` is not taken."""
    experts, gate = mlp.experts, getattr(mlp, "gate", None)
    tensors = [getattr(experts, name, None) for name in ("gate_up_proj", "down_proj")]
    shared = getattr(mlp, "shared_experts", None)
    return (all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in tensors) and not hasattr(mlp, "shared_expert")
            and all(hasattr(gate, a) for a in ("weight", "top_k"))
            and (shared is None or all(isinstance(getattr(shared, n, None), (nn.Linear, FP8Linear))
                                       for n in ("gate_proj", "up_proj", "down_proj"))))


def routing_of(mlp: nn.Module) -> dict:
    """The router's options as `moe_mlp` takes them: softmax over the experts (Qwen3-MoE), or
    sigmoid scores chosen with a correction bias within the best groups (GLM-4.5,
    `e_score_correction_bias`; MiniMax-M2: one group), the chosen weights then scaled."""
    gate = mlp.gate
    if hasattr(gate, "moe_statics"):  # ERNIE 4.5: float32 softmax, experts chosen with a bias, a floor on the sum
        return {"top_k": int(gate.top_k), "renormalise": True, "float32_logits": True, "norm_min": float(gate.norm_min)}
    if hasattr(mlp, "e_score_correction_bias"):  # MiniMax-M2: sigmoid scores and the block's bias, no groups
        return {"top_k": int(gate.top_k), "renormalise": True, "scoring": "sigmoid", "groups": 1, "top_groups": 1,
                "scale": 1.0}
    if not hasattr(gate, "norm_topk_prob"):  # always renormalised: Mixtral's router keeps the weights in
        # float32, Qwen3.5-MoE's (the one with a gated shared expert) casts them to the input's dtype
        return {"top_k": int(gate.top_k), "renormalise": True,
                "float32_weights": not hasattr(mlp, "shared_expert_gate")}
    options = {"top_k": int(gate.top_k), "renormalise": bool(gate.norm_topk_prob)}
    if hasattr(gate, "e_score_correction_bias"):
        options.update(scoring="sigmoid", groups=int(gate.num_group), top_groups=int(gate.topk_group),
                       scale=float(gate.routed_scaling_factor))
    return options


def router_bias(mlp: nn.Module) -> Tensor | None:
    """The bias a router adds to its scores to choose experts (never to weigh them): a sigmoid
    router's (GLM-4.5, DeepSeek-V3), the block's (MiniMax-M2), or ERNIE 4.5's softmax router's statics."""
    statics = getattr(mlp.gate, "moe_statics", None)  # ERNIE 4.5's, [1, E]
    if statics is not None:
        return statics.e_score_correction_bias[0]
    return getattr(mlp.gate, "e_score_correction_bias", getattr(mlp, "e_score_correction_bias", None))


def route(h: Tensor, router_w: Tensor, top_k: int, renormalise: bool, float32_weights: bool = False,
          bias: Tensor | None = None, float32_logits: bool = False, norm_min: float = 0.0) -> tuple[Tensor, Tensor]:
    """h [N, H] -> (weights [N, k] in h's dtype, or float32 as Mixtral keeps them; expert ids [N, k]),
    as the model's router: a softmax in float32 over all experts, the k largest, renormalised to sum
    to 1 if asked. ERNIE 4.5's: the logits in float32 too, the experts chosen by probability +
    `bias`, the sum floored at `norm_min`."""
    logits = F.linear(h.float(), router_w.float()) if float32_logits else F.linear(h, router_w)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    if bias is None:
        weights, experts = probs.topk(top_k, dim=-1)
    else:
        experts = (probs + bias).topk(top_k, dim=-1)[1]
        weights = probs.gather(1, experts)
    if renormalise:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total.clamp(min=norm_min) if norm_min else total)
    return (weights if float32_weights else weights.to(h.dtype)), experts


def route_sigmoid(h: Tensor, router_w: Tensor, bias: Tensor, *, top_k: int, renormalise: bool, groups: int,
                  top_groups: int, scale: float) -> tuple[Tensor, Tensor]:
    """GLM-4.5's (and DeepSeek-V3's) router, in float32 as the model computes it: sigmoid scores; the
    experts chosen by score + bias among the `top_groups` groups whose two best biased scores sum
    highest; weighed by their unbiased scores (renormalised if asked), times `scale`."""
    scores = F.linear(h.float(), router_w.float()).sigmoid()  # [N, E]
    choice = scores + bias
    if top_groups < groups:
        N, E = choice.shape
        best = choice.view(N, groups, E // groups).topk(2, dim=-1)[0].sum(dim=-1)  # [N, groups]
        kept = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(top_groups, dim=-1)[1], True)
        choice = choice.masked_fill(~kept.repeat_interleave(E // groups, dim=1), float("-inf"))
    experts = choice.topk(top_k, dim=-1)[1]
    weights = scores.gather(1, experts)
    if renormalise:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, experts


# Up to this many pair x expert entries (decoding: 256 slots x 8 of 128 experts = 262K), the
# pairs are grouped by counting, in a few small fused kernels; past it (a training row: 33-65K pairs)
# by one stable sort. Two radix sorts a layer took 2.9 of a decode step's 30.4 ms on an H200.
COUNTING_LIMIT = 1 << 19


class Grouping(NamedTuple):
    """The token-slot pairs grouped by expert: `order` [M] (row r of the grouped rows is pair
    order[r]), `inverse` [M] (pair i is grouped row inverse[i]), `ends` [E] int32 (each expert's
    end row)."""
    order: Tensor
    inverse: Tensor
    ends: Tensor


def grouped_offsets(experts: Tensor, num_experts: int) -> Grouping:
    """expert ids [N, k] -> the pairs grouped by expert, in pair order within each expert. Every
    shape is fixed by N, k and E: scatters, not bincount or nonzero."""
    flat = experts.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    ends = counts.cumsum(0, dtype=torch.int32)
    if flat.numel() * num_experts > COUNTING_LIMIT:
        order = flat.argsort(stable=True)
        return Grouping(order, inverse_permutation(order), ends)
    # pair i's row: its expert's first row + the pairs of the same expert before it
    one_hot = flat[:, None] == torch.arange(num_experts, device=flat.device)  # [M, E] (F.one_hot checks on the host)
    before = one_hot.cumsum(0).gather(1, flat[:, None]).squeeze(1) - 1
    inverse = (ends - counts).long()[flat] + before
    return Grouping(inverse_permutation(inverse), inverse, ends)


def inverse_permutation(order: Tensor) -> Tensor:
    """order [M] (a permutation of 0..M-1) -> its inverse: one scatter, where argsort would sort
    the M rows again."""
    inverse = torch.empty_like(order)
    inverse.scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return inverse


def expert_mlps(h: Tensor, weights: Tensor, experts: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """Sum over each token's experts of weight * down(silu(gate) * up): [N, H]."""
    k = experts.shape[1]
    g = grouped_offsets(experts, gate_up.shape[0])
    gate, up = grouped_mm(h[g.order // k], gate_up.transpose(1, 2), offs=g.ends).chunk(2, dim=-1)  # [N*k, I] each
    y = grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=g.ends)  # [N*k, H], grouped by expert
    return weighted_sum_by_token(y, g.inverse, weights)


def weighted_sum_by_token(y: Tensor, inverse: Tensor, weights: Tensor) -> Tensor:
    """Rows [N*k, H] grouped by expert -> each token's k rows weighed and summed [N, H], in
    float32 and rounded once. Back to token order by the inverse permutation: a gather, where a
    scatter-add into the tokens would contend on atomics (53 ms against 5 a step of
    Qwen3-30B-A3B on an H200)."""
    N, k = weights.shape
    if torch.compiler.is_compiling():
        # k row gathers added up: Inductor makes one pointwise kernel reading each row along H
        # (150 us a layer at Qwen3-30B-A3B's 8,192 tokens on an H100, where its reduction over
        # the k axis of a gathered [N, k, H] took 418)
        rows = inverse.view(N, k)
        total = y[rows[:, 0]].float() * weights[:, :1].float()
        for slot in range(1, k):
            total = total + y[rows[:, slot]].float() * weights[:, slot:slot + 1].float()
        return total.to(y.dtype)
    # eager (prefill, CPU): one gather and one reduction, where the k gathers would be 4k kernels
    return (y[inverse].view(N, k, -1) * weights[..., None].float()).sum(dim=1).to(y.dtype)


def route_gpt_oss(h: Tensor, router_w: Tensor, router_b: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """gpt-oss's router: the k largest logits (with the router's bias), a softmax over those k."""
    values, experts = F.linear(h, router_w, router_b).topk(top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), experts


def expert_mlps_gpt_oss(h: Tensor, weights: Tensor, experts: Tensor, gate_up: Tensor, gate_up_b: Tensor,
                        down: Tensor, down_b: Tensor, *, alpha: float, limit: float) -> Tensor:
    """gpt-oss's experts: weights stored [E, in, out] with biases; gate and up interleaved in
    gate_up's columns; a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate)."""
    k = experts.shape[1]
    g = grouped_offsets(experts, gate_up.shape[0])
    expert_of_row = experts.reshape(-1)[g.order]
    gu = grouped_mm(h[g.order // k], gate_up, offs=g.ends) + gate_up_b[expert_of_row]
    gate, up = gu[..., ::2].clamp(max=limit), gu[..., 1::2].clamp(min=-limit, max=limit)
    y = grouped_mm((up + 1) * (gate * torch.sigmoid(gate * alpha)), down, offs=g.ends) + down_b[expert_of_row]
    return weighted_sum_by_token(y, g.inverse, weights)


def moe_mlp(h: Tensor, router_w: Tensor, gate_up: Tensor, down: Tensor, bias: Tensor | None = None, *, top_k: int,
            renormalise: bool, scoring: str = "softmax", groups: int = 1, top_groups: int = 1,
            scale: float = 1.0, float32_weights: bool = False, float32_logits: bool = False,
            norm_min: float = 0.0) -> Tensor:
    """h [..., H] -> the mixture's output [..., H] (Qwen3-MoE, Mixtral, ERNIE 4.5; GLM-4.5's routed
    experts with `scoring` sigmoid and the router's `bias`; options from `routing_of`)."""
    flat = h.reshape(-1, h.shape[-1])
    if scoring == "sigmoid":
        weights, experts = route_sigmoid(flat, router_w, bias, top_k=top_k, renormalise=renormalise, groups=groups,
                                         top_groups=top_groups, scale=scale)
    else:
        weights, experts = route(flat, router_w, top_k, renormalise, float32_weights, bias, float32_logits, norm_min)
    return expert_mlps(flat, weights, experts, gate_up, down).to(h.dtype).view_as(h)


def moe_mlp_gpt_oss(h: Tensor, router_w: Tensor, router_b: Tensor, gate_up: Tensor, gate_up_b: Tensor, down: Tensor,
                    down_b: Tensor, *, top_k: int, alpha: float, limit: float) -> Tensor:
    """h [..., H] -> gpt-oss's mixture output [..., H]."""
    flat = h.reshape(-1, h.shape[-1])
    weights, experts = route_gpt_oss(flat, router_w, router_b, top_k)
    return expert_mlps_gpt_oss(flat, weights, experts, gate_up, gate_up_b, down, down_b, alpha=alpha,
                               limit=limit).view_as(h)
