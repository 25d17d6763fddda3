"""`target:` section of the training config: which frozen model, in which precision."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_train.utils.device import DtypeName


@dataclass
class TargetConfig:
    path: str = "builtin"
    """model directory, .gguf file, 'builtin' (SmolLM2-135M-Instruct), or preset:NAME (random weights, benchmarks)"""
    dtype: DtypeName = "auto"
    """auto = bfloat16 on GPU, float32 on CPU"""
    trust_remote_code: bool = False
    """let transformers run code shipped with the model"""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    """attention kernel of the frozen target's forward"""
    fp8: bool = False
    """float8 decoder matmuls in the frozen target (Hopper GPUs; see docs/performance.md)"""
