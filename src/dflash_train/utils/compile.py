"""torch.compile'd functions shared across a process.

Compiled mode wraps a few plain functions (the packed target's per-layer pieces, the LM
head's per-chunk cross-entropy, FlexAttention) with `torch.compile`. One wrapper per function,
options and process, so a second user of the same function (another lever of the benchmark,
the eval after training) reuses the graphs compiled for the first. The decoding engines swap
their per-layer functions for compiled ones in place (`compile_in_place`), falling back to the
plain ones when the compiler fails.
The plain functions are what the CPU tests run (compiling costs tens of seconds there).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from dflash_train.utils.device import sync

_COMPILED: dict[tuple[str, bool | None, bool], Callable] = {}


def compiled_once(fn: Callable, *, dynamic: bool | None = False, fullgraph: bool = True,
                  entries: int | None = None) -> Callable:
    """The process's one torch.compile'd wrapper of `fn` (by default fixed shapes, one graph).
    `entries`: how many compiled variants (shapes, closures) `fn` may need; Dynamo's recompile
    limit (default 8, process-wide) is raised to it, never lowered, since a fullgraph function
    past the limit fails rather than running uncompiled.

    Called while a graph is being traced, `fn` itself, and nothing is kept: the enclosing
    graph compiles it, and torch.compile called during tracing hands back `fn` unchanged. Kept,
    that plain `fn` would serve every later eager caller uncompiled (FlexAttention after a
    compiled training step would then build the whole score matrix: terabytes at eval shapes).
    """
    if torch.compiler.is_compiling():
        return fn
    if entries is not None:
        raise_recompile_limit(entries)
    key = (f"{fn.__module__}.{fn.__qualname__}", dynamic, fullgraph)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, dynamic=dynamic, fullgraph=fullgraph)
    return _COMPILED[key]


def raise_recompile_limit(entries: int) -> None:
    """Dynamo's recompile limit at least `entries` (its name before torch 2.7: cache_size_limit)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), entries))


def compile_in_place(swaps: Sequence[tuple[object, str]], trace: Callable[[], object], device: torch.device, *,
                     backend: str | Callable = "inductor") -> Exception | None:
    """Replace each function `owner.name` of `swaps` by its torch.compile'd version (fixed
    shapes, one graph) and call `trace` at once, without autograd (grad mode is part of what
    compiled code is keyed on), waiting for `device`, so that a compiler or kernel failure shows
    here and not in the middle of a run. On a failure, put every original back and return the
    exception; None when all compiled."""
    originals = [(owner, name, getattr(owner, name)) for owner, name in swaps]
    try:
        for owner, name, fn in originals:
            setattr(owner, name, torch.compile(fn, backend=backend, dynamic=False, fullgraph=True))
        with torch.no_grad():
            trace()
        sync(device)
    except Exception as exc:  # noqa: BLE001 - any compiler failure
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        return exc
    return None
