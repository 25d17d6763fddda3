"""Checkpoints saved quantized: a `quantization_config` in config.json (DeepSeek-V3's and MiniMax-M2's
block FP8, gpt-oss's MXFP4, compressed-tensors, GPTQ, AWQ, ...).

transformers would load such a checkpoint with its own quantized layers, whose weights are not
what the packed forward and the decoding engines read (a float8 tensor and a block scale, packed
integers). Where transformers can dequantize as it loads (the method's config has `dequantize`),
the target loads dequantized into the run's dtype: every path then takes it, and `target.fp8`
can quantize its decoder linears again, row by row. A method that stays quantized leaves the
model's own forward: the fast paths refuse it from its config, before any weight loads.

Where the project reads checkpoint tensors itself (a sharded target's rows, the layers a drafter
copies), block-FP8 weights are dequantized here (`dequantized_rows`), as transformers does.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from dflash_train.target.language_model import text_config

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"  # a block-FP8 weight's scales: `{name}_scale_inv` beside `{name}`


def dequantized_rows(rows: Tensor, scales: Tensor, start: int, block: tuple[int, int]) -> Tensor:
    """Rows start.. of a block-FP8 weight (DeepSeek-V3's layout: one float32 scale per block of
    block[0] x block[1] weights; `scales` the rows of blocks these rows fall in) as float32."""
    n, cols = rows.shape
    offset = start - (start // block[0]) * block[0]  # where these rows start in their first block
    per_weight = scales.float().repeat_interleave(block[0], 0)[offset:offset + n]
    return rows.float() * per_weight.repeat_interleave(block[1], 1)[:, :cols]


def plain_rows(rows: Tensor, start: int, block: tuple[int, int] | None, key: str, keys,
               slice_of: Callable[[str], Any]) -> Tensor:
    """Rows start.. of checkpoint tensor `key` as the model holds them: a block-FP8 weight (float8,
    with its scales among `keys`, read through `slice_of(name)[first:last]`) dequantized, else as read."""
    scales = key + SCALE_SUFFIX
    if block is None or rows.dtype not in FLOAT8_DTYPES or scales not in keys:
        return rows
    first, last = start // block[0], -(-(start + rows.shape[0]) // block[0])
    return dequantized_rows(rows, slice_of(scales)[first:last], start, block)


def quantization_of(config: Any) -> dict | None:
    """The checkpoint's quantization config as a dict (the root config's or its text config's), or None;
    a GGUF file's is None too: transformers always dequantizes GGUF tensors as it reads them."""
    for cfg in (config, text_config(config)):
        q = getattr(cfg, "quantization_config", None)
        if q is not None:
            q = q if isinstance(q, dict) else q.to_dict()
            return None if q.get("quant_method") == "gguf" else q
    return None


def dequantizing_config(config: Any):
    """The transformers quantization config that loads this checkpoint dequantized, or None (not
    quantized, or a method that cannot dequantize)."""
    from transformers.quantizers.auto import AutoQuantizationConfig

    q = quantization_of(config)
    if q is None:
        return None
    try:
        loaded = AutoQuantizationConfig.from_dict(dict(q))
    except (ValueError, KeyError, TypeError, ImportError):  # a method unknown here, or its package missing
        return None
    if not hasattr(loaded, "dequantize"):
        return None
    return AutoQuantizationConfig.from_dict({**q, "dequantize": True})


def stays_quantized(config: Any) -> str | None:
    """The quantization method of a checkpoint that loads quantized (no dequantizing load), else None."""
    q = quantization_of(config)
    if q is None or dequantizing_config(config) is not None:
        return None
    return str(q.get("quant_method", "unknown"))


def fp8_block(config: Any) -> tuple[int, int] | None:
    """The weight_block_size of a block-FP8 checkpoint (quant_method fp8), else None."""
    q = quantization_of(config)
    block = (q or {}).get("weight_block_size")
    if q is None or q.get("quant_method") != "fp8" or not block or len(block) != 2:
        return None
    return int(block[0]), int(block[1])
