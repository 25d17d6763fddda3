"""Decoding with the target: its static-KV decoder (decoder.py, attention.py, graphs.py, which
speculative/ builds on) and target-written training data (`dflash-train generate`); see docs/generate.md.

The public API of training-data generation:
"""

from __future__ import annotations

from dflash_train.generate.builtin import BuiltinEngine
from dflash_train.generate.config import GenerateConfig
from dflash_train.generate.decoder import UnsupportedModelError
from dflash_train.generate.engine import Completion, Request
from dflash_train.generate.http_engine import HttpEngine, HttpEngineError
from dflash_train.generate.sampling import Sampling
from dflash_train.generate.job import run_generate

__all__ = [
    "BuiltinEngine",
    "Completion",
    "GenerateConfig",
    "HttpEngine",
    "HttpEngineError",
    "Request",
    "Sampling",
    "UnsupportedModelError",
    "run_generate",
]
