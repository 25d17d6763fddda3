"""One captured step of the static-KV engines, per attention-length bucket.

Both the generation engine (generate/builtin.py: one decode step) and the speculative engine
(speculative/engine.py: draft and verify steps) run fixed-shape steps over static device
buffers. On CUDA each bucket's step is captured in a CUDA graph the first time it is needed
and replayed afterwards: one launch instead of ~1,000 small kernels per step. Eager on CPU.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import logging
import time
import warnings
from typing import Any, Callable, Hashable, Iterator, Sequence

import torch
from torch import Tensor

log = logging.getLogger(__name__)
# a failed capture is tried once more before the step runs eagerly for good
CAPTURE_ATTEMPTS = 2


def kv_buckets(max_len: int, smallest: int = 128) -> list[int]:
    """Attention lengths to specialise steps for: 128, 256, 512, ..., max_len. Short
    sequences then read only the cache they use, not all `max_len` positions."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return out + [max_len]


def bucket_of(size: int, buckets: Sequence[int]) -> int:
    """The smallest of the ascending `buckets` that holds `size`."""
    i = bisect.bisect_left(buckets, size)
    if i == len(buckets):
        raise ValueError(f"size {size} is larger than the largest bucket, {buckets[-1]}")
    return buckets[i]


# what one more prefill forward costs, in padded prompt tokens, when a refill is cut into chunks: a
# chunk's fixed time against the padding fewer, wider chunks carry. Captured on an H200, SmolLM2's
# chunks took ~3.3 ms + 1.4 us a padded token (1 x 256: 3.7 ms; 4 x 1,024: 8.3; 64 x 256: 25.3)
PREFILL_FORWARD_TOKENS = 2048


class PrefillShapes:
    """The padded shapes of prefill chunks, so that a few shapes serve every chunk (each a captured
    step on CUDA): a chunk's rows and its longest prompt's tokens are each rounded up to a power
    of two (tokens from `min_width`, both capped: rows at `max_rows` and at what `budget` holds at
    the narrowest width, tokens at `max_width`). Padded, a chunk holds at most `budget` tokens (a
    lone prompt any number up to `max_width`). `forward_tokens`: a chunk's fixed cost, in padded
    tokens (`chunks`)."""

    def __init__(self, max_rows: int, max_width: int, budget: int, min_width: int,
                 forward_tokens: int = PREFILL_FORWARD_TOKENS) -> None:
        self.forward_tokens = forward_tokens
        self.budget = max(budget, max_width)
        self.widths = kv_buckets(max_width, smallest=min_width)
        self.rows = kv_buckets(min(max_rows, max(1, self.budget // self.widths[0])), smallest=1)

    def shape(self, rows: int, width: int) -> tuple[int, int]:
        """The padded [rows, width] of a chunk of `rows` prompts, the longest `width` tokens."""
        return bucket_of(rows, self.rows), bucket_of(width, self.widths)

    def staged(self, slots: Sequence[int], prompts: Sequence[Sequence[int]]) -> tuple[tuple[int, int], list[int]]:
        """A chunk's padded shape and its inputs as one list to stage: [slots (rows), lengths
        (rows), ids (rows x width, right padded with 0)]. Padding rows repeat the first row (its
        slot, its prompt), so their cache writes are its bytes."""
        rows, width = self.shape(len(prompts), max(len(p) for p in prompts))
        pad = rows - len(prompts)
        prompts = [*prompts, *[prompts[0]] * pad]
        return (rows, width), ([*slots, *[slots[0]] * pad] + [len(p) for p in prompts]
                               + [t for p in prompts for t in [*p, *[0] * (width - len(p))]])

    @staticmethod
    def staged_size(shape: tuple[int, int]) -> int:
        """Elements `staged` writes for a chunk of `shape`: what an engine stages after them starts here."""
        rows, width = shape
        return rows * (2 + width)

    @staticmethod
    def views(stage: Tensor, shape: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
        """(slots [rows], lengths [rows], ids [rows, width]) of a chunk `staged` at the start of `stage`."""
        rows, width = shape
        return stage[:rows], stage[rows : 2 * rows], stage[2 * rows : PrefillShapes.staged_size(shape)].view(rows, width)

    def every_shape(self, max_width: int | None = None) -> list[tuple[int, int]]:
        """Every padded [rows, width] a chunk of prompts of at most `max_width` tokens (any,
        when None) can take, by width then rows: what to capture ahead of a run."""
        widest = bucket_of(min(max_width, self.widths[-1]), self.widths) if max_width else self.widths[-1]
        return [(rows, width) for width in self.widths if width <= widest
                for rows in self.rows if rows * width <= self.budget or rows == 1]

    def chunks(self, lengths: Sequence[int]) -> list[tuple[int, int]]:
        """Ascending prompt `lengths` -> [start, end) chunks that fit the budget padded, the cut that
        costs least: padded tokens plus `forward_tokens` a chunk (runs as long as fit the budget
        padded a refill of short and long prompts to about twice its tokens, since a run's longest
        prompt sets its width). Dynamic programming over the ends: the cheapest cover of the first
        `end` prompts never falls as `end` grows, so each row count needs only the longest run it holds."""
        best, take = [0] + [None] * len(lengths), [0] * (len(lengths) + 1)
        for end in range(1, len(lengths) + 1):
            width = bucket_of(lengths[end - 1], self.widths)
            for rows in self.rows:
                count = min(rows, end)
                padded_rows = bucket_of(count, self.rows)
                if padded_rows * width > self.budget and count > 1:
                    break
                cost = best[end - count] + padded_rows * width + self.forward_tokens
                if best[end] is None or cost < best[end]:
                    best[end], take[end] = cost, count
                if count == end:
                    break
        out, end = [], len(lengths)
        while end:
            out.append((end - take[end], end))
            end -= take[end]
        return out[::-1]


class GraphedStep:
    """`fn(key)` on static buffers, captured per key (a kv bucket, a prefill shape) on CUDA
    (eager elsewhere or when capturing fails: slower but correct beats a dead run). Returns what
    `fn` returns: on replay, the tensors the capture produced, which every replay overwrites in
    place. A failed capture is tried once more (something outside the step can invalidate one)
    before the step runs eagerly for good.

    Warm-up runs (on a side stream, as the CUDA-graph docs require: lazy init, cuBLAS handles,
    autotuning and torch.compile all happen there, never inside the capture) execute the
    real step. A step that updates state in place (positions += committed, ...) lists those
    buffers in `state`: they are restored after every warm-up run, so the replay that follows
    the capture performs the step exactly once. Everything else a step writes (caches,
    outputs) is a function of that state, so writing it again is harmless: capturing
    mid-run is safe.

    The capture is thread-local, as Inductor's CUDA graph trees capture: another thread's CUDA
    calls (the training loader pinning the next batch) cannot invalidate it. Python's cycle
    collector is held off during it (`quiet_collector`), and runs before the first key's capture
    only: a full collection of a generate job's large heap is slow, and every bucket or prefill
    shape first used mid-run would otherwise stall for it.

    `shared_pool`: every key's graph allocates from one memory pool, for a step captured at
    many keys (each graph's intermediates would otherwise keep their own memory). Then a
    replay may overwrite what another key's replay returned: read each output before the next
    replay (stream order does, for work queued in between)."""

    def __init__(self, fn: Callable[[Any], Any], state: Sequence[Tensor] = (), *, use_graphs: bool,
                 name: str, shared_pool: bool = False, describe: Callable[[Any], str] | None = None) -> None:
        self.fn, self.state, self.use_graphs, self.name = fn, list(state), use_graphs, name
        self.shared_pool = shared_pool
        self.describe = describe or (lambda kv_len: f"{kv_len} cache positions")
        self._graphs: dict[Hashable, tuple[Any, Any]] = {}
        self._pool: Any = None
        # the host's seconds spent capturing (the sync before, the warm-up runs, the capture):
        # what a key's first call costs beyond a replay
        self.capture_seconds = 0.0

    def __call__(self, key: Hashable) -> Any:
        if not self.use_graphs:
            return self.fn(key)
        if key not in self._graphs and not self._capture_or_give_up(key):
            return self.fn(key)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture_or_give_up(self, key: Hashable) -> bool:
        """Capture `key`'s step, a second time if the first capture fails (a capture can be
        invalidated by something outside the step); after two failures, run eagerly from now on."""
        errors: list[Exception] = []
        for _ in range(CAPTURE_ATTEMPTS):
            t0 = time.perf_counter()
            try:
                self._graphs[key] = self._capture(key)
            except Exception as exc:  # noqa: BLE001 - slower but correct beats a dead run
                errors.append(exc)
                continue
            self.capture_seconds += time.perf_counter() - t0
            if errors:
                log.info("captured the %s step for %s at attempt %d (the first failed: %s)", self.name,
                         self.describe(key), len(errors) + 1, _first_line(errors[0]))
            return True
        warnings.warn(f"CUDA graph capture of the {self.name} step for {self.describe(key)} failed "
                      f"{len(errors)} times, running it eagerly from now on (slower, the same tokens): "
                      + "; then: ".join(_first_line(e) for e in errors), stacklevel=3)
        self.use_graphs = False
        return False

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def warm_up(self, key: Hashable) -> None:
        """The step run twice before its capture, the state restored after each run (after one
        that raised too: the step then runs eagerly, from the state it had)."""
        saved = [t.clone() for t in self.state]
        for _ in range(2):
            try:
                self.fn(key)
            finally:
                for t, s in zip(self.state, saved):
                    t.copy_(s)

    def _capture(self, key: Hashable) -> tuple[Any, Any]:  # pragma: no cover - CUDA only
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                self.warm_up(key)
        finally:  # what runs next (the replay, or the step run eagerly) follows the warm-ups
            torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if self.shared_pool and self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with quiet_collector(collect=not self._graphs), \
                torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.fn(key)  # recorded, not run: the state is untouched until the replay
        log.log(logging.DEBUG if self.shared_pool else logging.INFO, "captured the %s step for %s in a CUDA graph",
                self.name, self.describe(key))
        return graph, out


@contextlib.contextmanager
def quiet_collector(collect: bool = True) -> Iterator[None]:
    """Python's cycle collector held off during a capture (run before it when `collect`: what a dead
    engine held is freed before a new one captures). Collected mid-capture, a dead engine's pinned
    buffers, events and graphs free themselves through CUDA calls that invalidate the capture."""
    enabled = gc.isenabled()
    if collect:
        gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
