"""The continuous-batching core of the static-KV engines.

Both engines keep `slots` sequences in static device buffers and advance them all at once by
fixed-shape steps: generate/builtin.py a decode step (one token a slot), speculative/engine.py a
round (a draft and a verify step). A slot whose sequence ends is handed the next prompt while
the others keep going, so the batch stays full. The skeleton they share lives here:

    RefillRule          when to admit: once a handful of slots are free, so that one prefill
                        (a forward of the target) serves several prompts
    PrefillStage        the admitted prompts in length-sorted chunks padded to a few shapes
                        (generate/graphs.py: PrefillShapes), each chunk's inputs staged on the
                        device by one copy, and a captured step per padded shape
    step_buckets        the attention lengths a step is captured for (GraphedStep, per bucket)
    Readback            a launched step's results on their way to the host, by launch parity
    DeviceMarks         device time between points of a step (CUDA events, or the wall clock)
    run_one_step_ahead  the loop: admit, launch step t, read step t-1

What differs stays in each engine: its rows, its steps and what a step reports.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import Tensor

from dflash_train.generate.attention import AttentionKind
from dflash_train.generate.graphs import GraphedStep, PrefillShapes, kv_buckets
from dflash_train.utils.device import copy_values_async

T = TypeVar("T")
Step = TypeVar("Step")  # what `launch` returns for `collect`


@dataclass(frozen=True)
class RefillRule:
    """Admit prompts once `min_free` slots are free (or as many as are waiting, when that is
    known and fewer): one prefill per handful of finished rows instead of one per row. It is a
    share of the slots, at least one and at most all, so an engine with no row running always
    admits."""

    min_free: int

    @classmethod
    def of(cls, slots: int, fraction: float) -> RefillRule:
        return cls(min(slots, max(1, int(slots * fraction))))

    def due(self, free: int, waiting: int | None = None) -> bool:
        """Whether to admit now, with `free` slots free and `waiting` prompts (None: unknown, a
        pull queue)."""
        if waiting is None:
            return free >= self.min_free
        return waiting > 0 and free >= min(self.min_free, waiting)


def pull(next_item: Callable[[], T | None], limit: int) -> list[T]:
    """Up to `limit` items from `next_item()`, stopping at its first None."""
    items: list[T] = []
    while len(items) < limit:
        item = next_item()
        if item is None:
            break
        items.append(item)
    return items


def run_one_step_ahead(admit: Callable[[], int], launch: Callable[[], Step | None],
                       collect: Callable[[Step], None], busy: Callable[[], bool], *,
                       overlap: bool = True) -> None:
    """Step every slot until no row is running and `admit` pulls nothing more.

    The loop runs one step ahead of the host: step t is launched before the results of step
    t-1 are read back (`collect`), so the device never waits for the host's bookkeeping (with
    `overlap` False, each step is read right after its launch). A row that ended in step t-1
    was therefore also stepped at t; `collect` drops what t reports for it (the slot's row is
    compared with the one it held at launch). Prompts are admitted only into slots known to be
    free and their prefill is queued behind the step in flight, so stream order keeps every
    slot's cache and inputs consistent.

    `admit()`: admit what is due; returns how many prompts it pulled (some may fail on their
    own, leaving nothing to run). `launch()`: queue a step and the copy of its results; None
    when no row needs one. `busy()`: whether a slot holds a row."""
    in_flight: Step | None = None
    while True:
        pulled = admit()
        if not busy() and in_flight is None:
            if pulled:
                continue  # everything pulled failed at once (bad prompts)
            return
        launched = launch()
        if in_flight is not None:
            collect(in_flight)
        in_flight = launched
        if in_flight is not None and not overlap:
            collect(in_flight)
            in_flight = None


def step_buckets(attention: AttentionKind, max_len: int) -> list[int]:
    """The attention lengths a step is specialised (and on CUDA captured) for. Dense attention
    reads cache positions [0, bucket) of every slot, the bucket set by the longest row: powers
    of two up to `max_len`. Flex reads each slot's own blocks whatever the length: one step."""
    return kv_buckets(max_len) if attention == "dense" else [max_len]


class PrefillStage:
    """The prefill of admitted prompts: length-sorted chunks padded to `shapes` (padding rows
    repeat a chunk's first row, so their cache writes are its bytes; prompts right padded,
    which causal attention never lets them see), each chunk's inputs in one device buffer by
    one copy: [slots, lengths, ids] (PrefillShapes.staged), then up to `values_per_row` values
    a row of the engine's own. Eager, a chunk's forward is a few thousand small kernels launched
    by the host (tens of ms for SmolLM2); a captured step per padded shape (`step`) is one."""

    def __init__(self, shapes: PrefillShapes, device: torch.device, values_per_row: int = 0) -> None:
        self.shapes = shapes
        rows = shapes.rows[-1]  # the largest chunk: slots, lengths, at most `budget` ids, the engine's values
        self.buffer = torch.zeros((2 + values_per_row) * rows + shapes.budget, dtype=torch.long, device=device)

    def step(self, fn: Callable[[tuple[int, int]], Any], *, use_graphs: bool, name: str) -> GraphedStep:
        """`fn(shape)` as a step captured per padded chunk shape, all shapes in one memory pool."""
        return GraphedStep(fn, use_graphs=use_graphs, name=name, shared_pool=True,
                           describe=lambda shape: "%d x %d tokens" % shape)

    def chunks(self, items: Sequence[T], length: Callable[[T], int]) -> list[list[T]]:
        """`items` sorted by `length` (stably), cut into the chunks of PrefillShapes.chunks."""
        ordered = sorted(items, key=length)
        return [ordered[start:end] for start, end in self.shapes.chunks([length(item) for item in ordered])]

    def put(self, slots: Sequence[int], prompts: Sequence[Sequence[int]], columns: Sequence[Sequence[int]] = (),
            tail: Sequence[int] = ()) -> tuple[tuple[int, int], Tensor]:
        """Stage a chunk, the host not waiting: its prompts into `slots`, then each of `columns`
        (a value per prompt, padded as the rows are), then `tail`. Returns the padded shape and
        the staged values on the device."""
        shape, values = self.shapes.staged(slots, prompts)
        pad = shape[0] - len(prompts)
        for column in columns:
            values += [*column, *[column[0]] * pad]
        values += tail
        return shape, copy_values_async(self.buffer[: len(values)], values)

    def views(self, shape: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor]:
        """(slots [rows], lengths [rows], ids [rows, width]) of the chunk staged at `shape`."""
        return PrefillShapes.views(self.buffer, shape)

    def columns(self, shape: tuple[int, int], count: int) -> Tensor:
        """The first `count` columns staged with the chunk at `shape`: [count, rows]."""
        rows = shape[0]
        return self.buffer[PrefillShapes.staged_size(shape):].narrow(0, 0, count * rows).view(count, rows)


class Readback:
    """Host buffers a launched step's results are copied into, two sets used by launch parity:
    the step in flight fills one while the host reads the other (the loop reads step t-1 after
    launching t and before launching t+1). Pinned on CUDA, so the copies are queued without the
    host waiting; an event after them is what the reader waits for, that step alone."""

    def __init__(self, buffers: Sequence[tuple[tuple[int, ...], torch.dtype]], device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._sets = [[torch.zeros(shape, dtype=dtype, pin_memory=self.cuda) for shape, dtype in buffers]
                      for _ in range(2)]
        self.launches = 0

    @property
    def parity(self) -> int:
        """Which of the two sets this launch uses: anything else kept per launch in flight (a
        round's device marks) is picked by it too."""
        return self.launches % 2

    def buffers(self) -> list[Tensor]:
        """This launch's host buffers (copy into them with non_blocking=True)."""
        return self._sets[self.parity]

    def sent(self) -> Any:
        """This launch's copies are queued: the next launch takes the other set. Returns the
        event to wait for before reading them (None on CPU, where they are done)."""
        self.launches += 1
        if not self.cuda:
            return None
        event = torch.cuda.Event()  # pragma: no cover - CUDA only
        event.record()
        return event


def wait_for(event: Any) -> None:
    """Wait for a `Readback.sent` event (nothing on CPU)."""
    if event is not None:  # pragma: no cover - CUDA only
        event.synchronize()


class DeviceMarks:
    """Device time between marks (a round's draft and verify, a prefill): CUDA events on a GPU,
    read once the work is known to be done (no extra wait); the wall clock on CPU, where every
    op is synchronous."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(n)] if self.cuda else []
        self.marks = [0.0] * n

    def mark(self, i: int) -> None:
        if self.cuda:  # pragma: no cover
            self.events[i].record()
        else:
            self.marks[i] = time.perf_counter()

    def seconds(self, i: int, j: int) -> float:
        """Seconds from mark i to mark j; call after the work behind mark j has completed."""
        if self.cuda:  # pragma: no cover
            return self.events[i].elapsed_time(self.events[j]) / 1000
        return self.marks[j] - self.marks[i]
