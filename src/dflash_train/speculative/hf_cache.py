"""Rolling a Hugging Face cache back to the committed tokens after a verify forward.

A verify forward appends the last committed token and d drafts to the target's cache; when
only a < d drafts are accepted, the cache must end up holding exactly the committed tokens,
as if the rejected ones had never been seen. How that is done depends on the layer:

* Full-attention KV (`DynamicLayer`): drop the last positions (`crop`). Exact and free.
* Sliding-window attention: a windowed cache layer has already thrown away the positions
  that fell out of its window, so it cannot be cropped back. It is not needed either: the
  mask, not the cache, applies the window, so these models decode with a plain cache of
  full-length layers (`decoding_cache`): every layer crops exactly. The KV of the local
  layers then grows with the sequence instead of stopping at the window (the price of
  exactness; eval decodes a few thousand positions).
* Recurrent state (linear attention: Qwen3-Next, Qwen3.5; or any layer kind we do not know):
  a state that folds every token in cannot give one back. Before each verify such layers
  are copied (`snapshot`); after a partial acceptance they are restored and the accepted
  tokens are run through the target again (`replay`), which advances them exactly. That
  second forward of a+1 tokens is the cost of these families, paid only on rounds that
  reject a draft; `ReplayStats` counts it.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dflash_train.target.language_model import text_config


# layer kinds whose keys and values a mask can window: a cache of full-length layers serves them all
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def decoding_cache(model) -> DynamicCache | None:
    """The cache to decode `model` with: a plain `DynamicCache` of full-length layers when every
    layer is attention (sliding windows included), else None (the model builds its own, whose
    non-attention layers `CacheRollback` snapshots)."""
    kinds = set(getattr(text_config(model.config), "layer_types", None) or ["full_attention"])
    return DynamicCache() if kinds <= ATTENTION_LAYER_TYPES else None


def _croppable(layer) -> bool:
    return type(layer) is DynamicLayer  # subclasses (sliding, linear, quantized) keep state crop cannot undo


@dataclass
class ReplayStats:
    rounds: int = 0  # verify forwards
    replays: int = 0  # of which rolled back by a replay forward
    replayed_tokens: int = 0
    seconds: float = 0.0  # in replay forwards (part of the verify time)


class CacheRollback:
    """Rolls one sequence's cache back after each verify forward (see the module docstring)."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.sync = sync  # waits for the device, so that `stats.seconds` times the replay forwards
        self.stats = ReplayStats()
        self._saved: dict[int, Any] | Any | None = None

    @staticmethod
    def needs_snapshot(cache) -> bool:
        layers = getattr(cache, "layers", None)
        return layers is None or not all(_croppable(layer) for layer in layers)

    def snapshot(self, cache) -> None:
        """Before a verify forward: copy what `crop` cannot roll back (nothing, for a plain cache)."""
        self.stats.rounds += 1
        if not self.needs_snapshot(cache):
            self._saved = None
            return
        layers = getattr(cache, "layers", None)
        if layers is None:  # a cache class of its own (older transformers): all of it
            self._saved = copy.deepcopy(cache)
        else:
            self._saved = {i: copy.deepcopy(layer) for i, layer in enumerate(layers) if not _croppable(layer)}

    def rollback(self, cache, verified: int, committed: list[int], replay: Callable[[list[int], Any], Any]):
        """After a verify forward of `verified` tokens: the cache holding the tokens before it plus
        `committed` (the verified token and the accepted drafts, a prefix of what was verified).
        Returns the cache to go on with."""
        rejected = verified - len(committed)
        if rejected <= 0:  # every draft accepted: the verify forward appended exactly the committed tokens
            return cache
        if self._saved is None:
            cache.crop(-rejected)  # `crop(-n)` removes n positions on every transformers version we support
            return cache
        if isinstance(self._saved, dict):
            for i, layer in enumerate(cache.layers):  # back to before the verify forward, then forward again
                if i in self._saved:
                    cache.layers[i] = self._saved[i]
                else:
                    layer.crop(-verified)
        else:
            cache = self._saved
        self._saved = None
        t = time.perf_counter()
        cache = replay(committed, cache)
        self.sync()
        self.stats.replays += 1
        self.stats.replayed_tokens += len(committed)
        self.stats.seconds += time.perf_counter() - t
        return cache
