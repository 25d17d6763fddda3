"""Weights of a target sharded with FSDP2 (target/sharded.py), gathered for code that reads them
itself instead of running the modules: the packed forward (target/packed.py).

FSDP2 gathers a module's weights in that module's forward hooks. The packed forward never calls
the modules, so it gathers them explicitly: `unshard` before reading a module's weights (whole
tensors then, not DTensor shards), `reshard` after, which frees them. Decoder layers are gathered
one ahead (`layers_gathered`): layer i + 1's all-gather is in flight while layer i computes, as
FSDP2's own forward prefetch does, so a rank holds its shards plus about two whole layers.

Every rank of the group must gather the same modules in the same order (each gather is a
collective): the packed forward runs the same layers on every rank, whatever its batch.
A module that is not sharded passes through untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule


def unsharded_type(module: nn.Module) -> type:
    """The module's own class: FSDP2 gives a sharded module a subclass of it (FSDPEmbedding, ...)."""
    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[nn.Module]:
    """`module` with its own weights whole inside the block (not its submodules': FSDP2's unshard
    is not recursive)."""
    if not isinstance(module, FSDPModule):
        yield module
        return
    module.unshard()
    try:
        yield module
    finally:
        module.reshard()


@contextlib.contextmanager
def layers_gathered(layers: Sequence[nn.Module], count: int) -> Iterator[Iterator[int]]:
    """An iterator over 0 .. count-1 that holds layer i's weights whole while the loop body for i
    runs and layer i + 1's all-gather in flight; each layer freed when the body moves on. Leaving
    the block early (an error) waits for the all-gather in flight and frees every layer."""
    pending: dict[int, object] = {}  # layer -> its unshard handle, not yet waited for
    whole: set[int] = set()  # layers waited for, not yet freed

    def prefetch(i: int) -> None:
        if i < count and isinstance(layers[i], FSDPModule):
            pending[i] = layers[i].unshard(async_op=True)

    def each() -> Iterator[int]:
        prefetch(0)
        for i in range(count):
            handle = pending.pop(i, None)
            if handle is not None:
                handle.wait()
                whole.add(i)
            prefetch(i + 1)
            yield i
            if i in whole:
                layers[i].reshard()
                whole.discard(i)

    try:
        yield each()
    finally:  # left early: nothing stays gathered
        for i, handle in pending.items():
            handle.wait()
            whole.add(i)
        for i in whole:
            layers[i].reshard()
