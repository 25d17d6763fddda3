"""Checkpoints saved quantized: a `quantization_config` in config.json (DeepSeek-V3's and MiniMax-M2's
block FP8, gpt-oss's MXFP4, compressed-tensors, GPTQ, AWQ, ...).

transformers would load such a checkpoint with its own quantized layers, whose weights are not
what the packed forward and the decoding engines read (a float8 tensor and a block scale, packed
integers). Where transformers can dequantize as it loads (the method's config has `dequantize`),
the target loads dequantized into the run's dtype: every path then takes it, and `target.fp8`
can quantize its decoder linears again, row by row. A method that stays quantized leaves the
model's own forward: the fast paths refuse it from its config, before any weight loads.
"""

from __future__ import annotations

from typing import Any

from dflash_train.target.language_model import text_config


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
