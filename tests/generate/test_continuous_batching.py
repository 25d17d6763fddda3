"""generate/continuous_batching.py: the refill rule, the one-step-ahead loop, the prefill stage
and the readback buffers the two static-KV engines share, on CPU, against hand-worked runs and
brute force."""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch

from dflash_train.generate.continuous_batching import (
    PrefillStage,
    Readback,
    RefillRule,
    pull,
    run_one_step_ahead,
    step_buckets,
)
from dflash_train.generate.graphs import PrefillShapes, kv_buckets


def test_refill_rule_min_free_is_a_share_of_the_slots_within_one_and_all():
    assert [RefillRule.of(64, f).min_free for f in (0.0, 0.125, 0.5, 1.0, 3.0)] == [1, 8, 32, 64, 64]
    assert RefillRule.of(3, 0.125).min_free == 1 and RefillRule.of(1, 0.9).min_free == 1


@pytest.mark.parametrize("slots", [1, 3, 8])
@pytest.mark.parametrize("fraction", [0.125, 0.5, 1.0, 2.0])
def test_refill_rule_admits_as_the_engines_did(slots, fraction):
    """Brute force over every (free, waiting): with a known queue, admit when some prompt waits
    and a slot is free, and either min(share, waiting) slots are free or nothing runs; with a
    pull queue, once the share is free or nothing runs."""
    rule = RefillRule.of(slots, fraction)
    share = max(1, int(slots * fraction))  # unclamped, as the engines computed it
    for free in range(slots + 1):
        idle = free == slots
        assert rule.due(free) == (free >= share or idle), (free,)
        for waiting in range(2 * slots + 2):
            expected = bool(waiting and free and (free >= min(share, waiting) or idle))
            assert rule.due(free, waiting) == expected, (free, waiting)


def test_pull_stops_at_the_limit_or_the_first_none():
    queue = deque([1, 2, 3])
    assert pull(lambda: queue.popleft() if queue else None, 2) == [1, 2] and list(queue) == [3]
    assert pull(lambda: queue.popleft() if queue else None, 5) == [3] and pull(lambda: None, 5) == []
    assert pull(lambda: 7, 0) == []


class FakeEngine:
    """Rows of scripted lengths (steps until they end) in `slots` slots, run by the core loop;
    the log records every admission, launch and collect in order. A prompt named "bad" fails
    at admission, as an over-long prompt does."""

    def __init__(self, slots: int, prompts: list[tuple[str, int]], min_free: int = 1):
        self.rule, self.queue = RefillRule(min_free), deque(prompts)
        self.rows: list[list | None] = [None] * slots  # [name, steps left]
        self.free = list(range(slots - 1, -1, -1))
        self.log: list[tuple] = []
        self.finished: list[str] = []
        self.launches = 0

    def admit(self) -> int:
        if not self.rule.due(len(self.free)):
            return 0
        pulled = pull(lambda: self.queue.popleft() if self.queue else None, len(self.free))
        for name, steps in pulled:
            if name != "bad":
                self.rows[self.free.pop()] = [name, steps]
        if pulled:
            self.log.append(("admit", *[name for name, _ in pulled]))
        return len(pulled)

    def launch(self):
        live = [(slot, row) for slot, row in enumerate(self.rows) if row is not None]
        if not live:
            return None
        self.launches += 1
        self.log.append(("launch", self.launches, *[row[0] for _, row in live]))
        return self.launches, live

    def collect(self, launched) -> None:
        number, live = launched
        self.log.append(("collect", number))
        for slot, row in live:
            if self.rows[slot] is not row:  # the row ended before this step: its token is dropped
                continue
            row[1] -= 1
            if row[1] == 0:
                self.finished.append(row[0])
                self.rows[slot] = None
                self.free.append(slot)

    def run(self, overlap: bool = True) -> None:
        run_one_step_ahead(self.admit, self.launch, self.collect, lambda: any(self.rows), overlap=overlap)


def test_the_loop_reads_each_step_after_launching_the_next():
    """Worked by hand: A lasts 2 steps, B and C 1. Step 2 is launched before step 1 is read, so
    B's slot is known free only then and C lands in step 3; A and B were stepped once more
    than they needed (steps 2 and 3), and the loop drains the last step before returning."""
    engine = FakeEngine(2, [("A", 2), ("B", 1), ("C", 1)])
    engine.run()
    assert engine.log == [("admit", "A", "B"), ("launch", 1, "A", "B"), ("launch", 2, "A", "B"), ("collect", 1),
                          ("admit", "C"), ("launch", 3, "A", "C"), ("collect", 2), ("launch", 4, "C"),
                          ("collect", 3), ("collect", 4)]
    assert engine.finished == ["B", "A", "C"] and not any(engine.rows) and sorted(engine.free) == [0, 1]


def test_the_loop_without_overlap_reads_each_step_at_once():
    engine = FakeEngine(2, [("A", 2), ("B", 1), ("C", 1)])
    engine.run(overlap=False)
    assert engine.log == [("admit", "A", "B"), ("launch", 1, "A", "B"), ("collect", 1), ("admit", "C"),
                          ("launch", 2, "A", "C"), ("collect", 2)]
    assert engine.finished == ["B", "A", "C"]


def test_the_loop_goes_on_when_every_pulled_prompt_failed_and_waits_for_the_refill_share():
    """Two bad prompts fill the first admission and leave nothing running: the loop admits
    again instead of returning. With 3 slots and a share of 2, D waits until two are free."""
    engine = FakeEngine(2, [("bad", 1), ("bad", 1), ("A", 1)])
    engine.run()
    assert engine.log[:3] == [("admit", "bad", "bad"), ("admit", "A"), ("launch", 1, "A")]
    assert engine.finished == ["A"] and engine.launches == 2
    engine = FakeEngine(3, [("A", 1), ("B", 3), ("C", 4), ("D", 1)], min_free=2)
    engine.run(overlap=False)
    admits = [entry for entry in engine.log if entry[0] == "admit"]
    assert admits == [("admit", "A", "B", "C"), ("admit", "D")]
    assert engine.log.index(("admit", "D")) == engine.log.index(("collect", 3)) + 1  # B ended in step 3
    assert engine.finished == ["A", "B", "D", "C"]


def test_step_buckets_dense_powers_of_two_flex_one():
    assert step_buckets("dense", 1024) == kv_buckets(1024) == [128, 256, 512, 1024]
    assert step_buckets("flex", 1024) == [1024]


def test_prefill_stage_chunks_are_length_sorted_runs_of_the_shapes():
    """Lengths 2, 3, 5, 10, 20 under a 40-token budget, widths 4, 8, 16, 20, rows 1, 2, 4, 5:
    [2, 3, 5] padded to 4 x 8, then [10, 20] as 2 x 20; equal lengths keep their order."""
    stage = PrefillStage(PrefillShapes(5, 20, 40, 4), torch.device("cpu"))
    items = [("a", 10), ("b", 2), ("c", 20), ("d", 3), ("e", 5), ("f", 3)]
    chunks = stage.chunks(items, length=lambda item: item[1])
    assert chunks == [[("b", 2), ("d", 3), ("f", 3), ("e", 5)], [("a", 10), ("c", 20)]]
    assert [stage.shapes.shape(len(c), c[-1][1]) for c in chunks] == [(4, 8), (2, 20)]


def test_prefill_stage_puts_a_chunk_and_its_values_in_one_buffer():
    """Three prompts padded to 4 rows of 4 tokens: the padding row repeats the first one's slot,
    prompt and column values; the tail follows the columns; the views read them back."""
    stage = PrefillStage(PrefillShapes(4, 8, 16, 4), torch.device("cpu"), values_per_row=3)
    assert stage.buffer.numel() == (2 + 3) * 4 + 16
    shape, staged = stage.put([5, 2, 7], [[11, 12], [13], [14, 15, 16]], columns=[[1, 2, 3], [40, 50, 60]],
                              tail=[0, 2])
    assert shape == (4, 4)
    ids = [11, 12, 0, 0, 13, 0, 0, 0, 14, 15, 16, 0, 11, 12, 0, 0]
    assert staged.tolist() == [5, 2, 7, 5, 2, 1, 3, 2, *ids, 1, 2, 3, 1, 40, 50, 60, 40, 0, 2]
    slots, lengths, tokens = stage.views(shape)
    assert slots.tolist() == [5, 2, 7, 5] and lengths.tolist() == [2, 1, 3, 2]
    assert tokens.tolist() == [ids[i:i + 4] for i in range(0, 16, 4)]
    assert stage.columns(shape, 2).tolist() == [[1, 2, 3, 1], [40, 50, 60, 40]]
    assert stage.columns(shape, 1)[0].data_ptr() == stage.buffer[24:].data_ptr()  # a view, no copy


@pytest.mark.parametrize("seed", range(4))
def test_every_shape_holds_every_chunk_a_run_can_make(seed):
    rng = random.Random(seed)
    shapes = PrefillShapes(*rng.choice([(5, 20, 40, 4), (64, 1024, 16384, 32), (3, 256, 256, 32)]))
    widest = rng.choice([None, rng.randint(1, shapes.widths[-1] + 50)])
    every = shapes.every_shape(widest)
    assert len(every) == len(set(every))
    for _ in range(20):
        top = min(widest or shapes.widths[-1], shapes.widths[-1])
        lengths = sorted(rng.randint(1, top) for _ in range(rng.randint(1, 100)))
        for start, end in shapes.chunks(lengths):
            assert shapes.shape(end - start, lengths[end - 1]) in every
    assert PrefillShapes(5, 20, 40, 4).every_shape() == [(1, 4), (2, 4), (4, 4), (5, 4), (1, 8), (2, 8), (4, 8),
                                                         (5, 8), (1, 16), (2, 16), (1, 20), (2, 20)]
    assert PrefillShapes(5, 20, 40, 4).every_shape(7) == [(1, 4), (2, 4), (4, 4), (5, 4), (1, 8), (2, 8), (4, 8),
                                                          (5, 8)]


def test_readback_alternates_two_sets_of_buffers_by_launch():
    readback = Readback([((2, 3), torch.long), ((3,), torch.float32)], torch.device("cpu"))
    first = readback.buffers()
    assert [(b.shape, b.dtype) for b in first] == [((2, 3), torch.long), ((3,), torch.float32)]
    assert readback.sent() is None and readback.launches == 1  # CPU: the copies are done
    second = readback.buffers()
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(first, second))
    readback.sent()
    assert [b.data_ptr() for b in readback.buffers()] == [b.data_ptr() for b in first]
