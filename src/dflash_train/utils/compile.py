"""torch.compile'd functions shared across a process.

Compiled mode wraps a few plain functions (the packed target's per-layer pieces, the LM
head's per-chunk cross-entropy) with `torch.compile(dynamic=False, fullgraph=True)`. One
wrapper per function and process, so a second user of the same function (another lever
of the benchmark, the eval after training) reuses the graphs compiled for the first.
The plain functions are what the CPU tests run (compiling costs tens of seconds there).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_COMPILED: dict[str, Callable] = {}


def compiled_once(fn: Callable) -> Callable:
    """The process's one torch.compile'd wrapper of `fn` (fixed shapes, one whole graph)."""
    key = f"{fn.__module__}.{fn.__qualname__}"
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _COMPILED[key]
