"""The op sequence of Hugging Face Llama/Qwen decoder modules, as plain functions.

Shared by the built-in generation decoder (generate/decoder.py), which must reproduce a
target's forward exactly, and the drafter's Qwen3-style layers (drafter/model.py).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float, *, scale_in_float32: bool = False) -> Tensor:
    """RMSNorm with statistics in float32.

    Default: exactly `LlamaRMSNorm.forward` (cast back to the input dtype, then scale; the
    result takes the promoted dtype of weight and input). `scale_in_float32`: scale the
    float32 value and cast the product to the input dtype, so that under bf16 autocast with
    float32 master weights q, k and v reach the attention kernel in one dtype (the drafter).
    """
    dtype = x.dtype
    normed = x.to(torch.float32)
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_float32:
        return (weight * normed).to(dtype)
    return weight * normed.to(dtype)


def normed_qk(q: Tensor, k: Tensor, qn_w: Tensor | None, kn_w: Tensor | None, norm: Callable[[Tensor, Tensor], Tensor],
              *, n_heads: int, n_kv: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """q, k [..., heads * head_dim] -> [..., heads, head_dim], normed by `norm(x, weight)` as the norm's
    width says: over the whole projection (MiniMax-M2, OLMo 2), per head (Qwen3, Gemma 3, EXAONE 4),
    or not at all (no q/k norm)."""
    lead = q.shape[:-1]
    whole = qn_w is not None and qn_w.shape[-1] != head_dim
    if whole:
        q, k = norm(q, qn_w), norm(k, kn_w)
    q, k = q.view(*lead, n_heads, head_dim), k.view(*lead, n_kv, head_dim)
    if qn_w is not None and not whole:
        q, k = norm(q, qn_w), norm(k, kn_w)
    return q, k


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_pairs(x: Tensor) -> Tensor:
    """Each pair of neighbouring dims (x0, x1) turned to (-x1, x0): ERNIE 4.5's rotate_half."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, paired: bool = False) -> Tensor:
    """Rotary position embedding; `cos`/`sin` broadcast against `x` [..., head_dim]. Tables narrower
    than the head (partial rotary embeddings, as GLM's and some Phi models') rotate its first dimensions and pass
    the rest through, as transformers' apply_rotary_pos_emb does. `paired`: ERNIE 4.5's, each pair
    of neighbouring dims turned together (tables with each frequency twice in a row). Tables kept
    in float32 beside a lower-precision `x` (ERNIE's) rotate in float32, cast back."""
    if cos.dtype != x.dtype:
        return apply_rope(x.float(), cos, sin, paired).to(x.dtype)
    width = cos.shape[-1]
    rotate = rotate_pairs if paired else rotate_half
    if width == x.shape[-1]:
        return (x * cos) + (rotate(x) * sin)
    rotated, passed = x[..., :width], x[..., width:]
    return torch.cat([(rotated * cos) + (rotate(rotated) * sin), passed], dim=-1)


def keys_for_attention(k: Tensor, v: Tensor, n_heads: int, grouped: bool) -> tuple[Tensor, Tensor]:
    """k, v as the packed forward's attention takes them: `grouped`, one head per group of query heads
    (the kernel reads each for its group: enable_gqa); else repeated to every query head (`repeat_kv`)."""
    return (k, v) if grouped else repeat_kv(k, v, n_heads)


def repeat_kv(k: Tensor, v: Tensor, n_heads: int) -> tuple[Tensor, Tensor]:
    """k, v [..., n_kv, head_dim] -> [..., n_heads, head_dim], each kv head repeated over its group of
    query heads as transformers' repeat_kv does (every SDPA kernel takes the call, GQA or not)."""
    n_kv, head_dim = k.shape[-2:]
    rep = n_heads // n_kv
    if rep == 1:
        return k, v
    lead = k.shape[:-2]
    return tuple(t[..., None, :].expand(*lead, n_kv, rep, head_dim).reshape(*lead, n_heads, head_dim) for t in (k, v))


def soft_cap(logits: Tensor, cap: float | None) -> Tensor:
    """Gemma 2's final logit soft-capping, cap * tanh(logits / cap), in the order of operations
    of the Hugging Face forward (so that the same dtype gives the same numbers); no cap: unchanged."""
    if not cap:
        return logits
    return torch.tanh(logits / cap) * cap
