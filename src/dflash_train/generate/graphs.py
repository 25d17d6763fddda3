"""One captured step of the static-KV engines, per attention-length bucket.

Both the generation engine (generate/builtin.py: one decode step) and the speculative engine
(speculative/engine.py: draft and verify steps) run fixed-shape steps over static device
buffers. On CUDA each bucket's step is captured in a CUDA graph the first time it is needed
and replayed afterwards: one launch instead of ~1,000 small kernels per step. Eager on CPU.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def kv_buckets(max_len: int, smallest: int = 128) -> list[int]:
    """Attention lengths to specialise steps for: 128, 256, 512, ..., max_len. Short
    sequences then read only the cache they use, not all `max_len` positions."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


class GraphedStep:
    """`fn(kv_len)` on static buffers, captured per kv bucket on CUDA (eager elsewhere or when
    a capture fails: slower but correct beats a dead run). Returns what `fn` returns: on
    replay, the tensors the capture produced, which every replay overwrites in place.

    Warm-up runs (on a side stream, as the CUDA-graph docs require: lazy init, cuBLAS handles,
    autotuning and torch.compile all happen there, never inside the capture) execute the
    real step. A step that updates state in place (positions += committed, ...) lists those
    buffers in `state`: they are restored after every warm-up run, so the replay that follows
    the capture performs the step exactly once. Everything else a step writes (caches,
    outputs) is a function of that state, so writing it again is harmless: capturing
    mid-run is safe."""

    def __init__(self, fn: Callable[[int], Any], state: Sequence[Tensor] = (), *, use_graphs: bool,
                 name: str) -> None:
        self.fn, self.state, self.use_graphs, self.name = fn, list(state), use_graphs, name
        self._graphs: dict[int, tuple[Any, Any]] = {}

    def __call__(self, kv_len: int) -> Any:
        if not self.use_graphs:
            return self.fn(kv_len)
        if kv_len not in self._graphs:
            try:
                self._graphs[kv_len] = self._capture(kv_len)
            except Exception as exc:  # noqa: BLE001 - slower but correct beats a dead run
                warnings.warn(f"CUDA graph capture of the {self.name} step failed, running eagerly: {exc}",
                              stacklevel=2)
                self.use_graphs = False
                return self.fn(kv_len)
        graph, out = self._graphs[kv_len]
        graph.replay()
        return out

    def _capture(self, kv_len: int) -> tuple[Any, Any]:  # pragma: no cover - CUDA only
        saved = [t.clone() for t in self.state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(kv_len)
                for t, s in zip(self.state, saved):
                    t.copy_(s)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self.fn(kv_len)  # recorded, not run: the state is untouched until the replay
        log.info("captured the %s step for %d cache positions in a CUDA graph", self.name, kv_len)
        return graph, out
