"""Choosing the next token: greedy, or temperature / top-k / top-p sampling.

Sampling uses the Gumbel-max trick with noise from a counter-based hash of
(request key, step, vocabulary id) instead of a stateful torch.Generator. A row's random
numbers therefore depend only on its own request, never on which slot it sits in or what
else is in the batch, so a sampled conversation comes out the same in a resumed run, at
another batch size, or alone (up to floating-point differences in the logits themselves).

All hash arithmetic stays below 2**63 in int64, so there is no overflow on any backend.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # < 2**27: a 32-bit value times this stays far below 2**63
_GOLDEN = 0x9E3779B1


@dataclass(frozen=True)
class Sampling:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 mean no filtering."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


def request_key(*parts: object) -> int:
    """A stable 32-bit key from any parts, e.g. (seed, conversation id, turn)."""
    digest = hashlib.sha256("\x1f".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (bijective, good avalanche) on int64 tensors holding uint32 values."""
    x = (((x >> 16) ^ x) * _MIX) & _M32
    x = (((x >> 16) ^ x) * _MIX) & _M32
    return (x >> 16) ^ x


def gumbel_noise(keys: Tensor, steps: Tensor, vocab: int) -> Tensor:
    """Standard Gumbel noise [R, vocab] (fp32), a pure function of (key, step, column)."""
    row = _mix32(_mix32(keys & _M32) ^ (steps & _M32))
    cols = torch.arange(vocab, device=keys.device, dtype=torch.int64) * _GOLDEN
    h = _mix32(_mix32((row[:, None] + cols[None, :]) & _M32))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # uniform in (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))


def _filter(x: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (to -inf) what top-k and then top-p remove, as transformers' warpers do in that order."""
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(x.shape[-1], device=x.device)[None, :]
    remove = (top_k[:, None] > 0) & (rank >= top_k[:, None])
    probs = sorted_x.masked_fill(remove, float("-inf")).softmax(dim=-1)
    # keep the smallest prefix whose probability reaches top_p (the first token always stays)
    remove |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    return x.masked_fill(torch.zeros_like(remove).scatter(1, order, remove), float("-inf"))


def select_tokens(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    keys: Tensor,
    steps: Tensor,
    *,
    any_sampled: bool,
    any_filtered: bool,
) -> Tensor:
    """Next token ids [R] for logits [R, V]. Rows with temperature 0 take the argmax (the first
    maximum, like transformers' greedy search). `any_sampled`/`any_filtered` are host-side
    flags that let an all-greedy batch skip the sampling work entirely."""
    greedy = logits.argmax(dim=-1)
    if not any_sampled:
        return greedy
    x = logits.float() / temperature.clamp_min(1e-5)[:, None]
    if any_filtered:
        x = _filter(x, top_k, top_p)
    sampled = (x + gumbel_noise(keys, steps, x.shape[-1])).argmax(dim=-1)
    return torch.where(temperature > 0, sampled, greedy)
