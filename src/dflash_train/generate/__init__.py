"""Target-written training data (`dflash-train generate`); see docs/generate.md.

Importing this package is cheap; torch loads with the engine modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

_WHERE = {
    "BuiltinEngine": "builtin",
    "Completion": "engine",
    "GenerateConfig": "config",
    "HttpEngine": "http_engine",
    "HttpEngineError": "http_engine",
    "Request": "engine",
    "Sampling": "sampling",
    "UnsupportedModelError": "decoder",
    "run_generate": "tasks",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:  # pragma: no cover
    from dflash_train.generate.builtin import BuiltinEngine
    from dflash_train.generate.config import GenerateConfig
    from dflash_train.generate.decoder import UnsupportedModelError
    from dflash_train.generate.engine import Completion, Request
    from dflash_train.generate.http_engine import HttpEngine, HttpEngineError
    from dflash_train.generate.sampling import Sampling
    from dflash_train.generate.tasks import run_generate
