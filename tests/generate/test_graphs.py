"""generate/graphs.py: bucket sizes and the padded prefill chunk rule, against brute force; what a
failed capture leads to (emulated on the CPU: the capture itself needs CUDA)."""

from __future__ import annotations

import gc
import random
import warnings
import weakref

import pytest
import torch

from dflash_train.generate.graphs import GraphedStep, PrefillShapes, bucket_of, kv_buckets, quiet_collector


def test_buckets_are_powers_of_two_up_to_the_cap():
    assert kv_buckets(2048, smallest=64) == [64, 128, 256, 512, 1024, 2048]
    assert kv_buckets(1000, smallest=64) == [64, 128, 256, 512, 1000]
    assert kv_buckets(20, smallest=64) == [20]
    assert [bucket_of(n, [1, 2, 4, 5]) for n in range(1, 6)] == [1, 2, 4, 4, 5]
    with pytest.raises(ValueError, match="larger than the largest bucket"):
        bucket_of(6, [1, 2, 4, 5])


def _padded(shapes, rows, width):  # brute force: the smallest power of two (or the cap) at or above each
    r = min([2**k for k in range(12) if 2**k >= rows and 2**k < shapes.rows[-1]] + [shapes.rows[-1]])
    w = min([shapes.widths[0] * 2**k for k in range(12)
             if shapes.widths[0] * 2**k >= width and shapes.widths[0] * 2**k < shapes.widths[-1]] + [shapes.widths[-1]])
    return r, w


def _cost(shapes, lengths, cuts):  # None where a chunk of several prompts overflows the budget padded
    total = 0
    for start, end in cuts:
        rows, width = _padded(shapes, end - start, lengths[end - 1])
        if end - start > shapes.rows[-1] or (rows * width > shapes.budget and end - start > 1):
            return None
        total += rows * width + shapes.forward_tokens
    return total


@pytest.mark.parametrize("forward_tokens", [0, 64, 4096])
@pytest.mark.parametrize("seed", range(8))
def test_chunks_are_the_cheapest_cut_that_fits_the_budget_padded(seed, forward_tokens):
    """Against every cut of up to 11 prompts: padded tokens plus a chunk's fixed cost, least."""
    rng = random.Random(seed)
    max_rows, max_width, budget, min_width = rng.choice([(1, 300, 500, 16), (7, 300, 1000, 16), (64, 2048, 16384, 64),
                                                         (5, 20, 40, 4)])
    shapes = PrefillShapes(max_rows, max_width, budget, min_width, forward_tokens=forward_tokens)
    lengths = sorted(rng.randint(1, max_width) for _ in range(rng.randint(1, 11)))
    chunks = shapes.chunks(lengths)
    assert [s for s, _ in chunks] == [0] + [e for _, e in chunks[:-1]] and chunks[-1][1] == len(lengths)
    assert all(shapes.shape(end - start, lengths[end - 1]) == _padded(shapes, end - start, lengths[end - 1])
               for start, end in chunks)
    every_cut = []
    for mask in range(2 ** (len(lengths) - 1)):
        ends = [i + 1 for i in range(len(lengths) - 1) if mask >> i & 1] + [len(lengths)]
        every_cut.append(list(zip([0] + ends[:-1], ends)))
    assert _cost(shapes, lengths, chunks) == min(c for c in (_cost(shapes, lengths, cut) for cut in every_cut)
                                                 if c is not None)


def test_a_refill_of_short_prompts_and_one_long_is_cut_before_the_long_one():
    """Eight 10-token prompts and one of 1,000: one run would pad all nine to 16 x 1,024 (16,384
    tokens); cut, 8 x 64 and 1 x 1,024 (1,536 tokens, two forwards)."""
    shapes = PrefillShapes(1536, 2048, 16384, 64)
    assert shapes.chunks([10] * 8 + [1000]) == [(0, 8), (8, 9)]
    assert PrefillShapes(1536, 2048, 16384, 64, forward_tokens=20000).chunks([10] * 8 + [1000]) == [(0, 9)]


class _Replay:
    def __init__(self, fn, key):
        self.fn, self.key = fn, key

    def replay(self):
        self.fn(self.key)


def _counting_step(monkeypatch, failures: int):
    """A step whose state counts its runs, and a capture (emulated: warm-ups, then a graph that
    replays the step) that raises the first `failures` times it is tried."""
    state = torch.zeros(1, dtype=torch.long)
    step = GraphedStep(lambda key: state.add_(key), [state], use_graphs=True, name="decode")
    attempts = []

    def capture(self, key):
        attempts.append(key)
        self.warm_up(key)
        if len(attempts) <= failures:
            raise RuntimeError(f"operation failed due to a previous error during capture ({len(attempts)})\nmore")
        return _Replay(self.fn, key), state

    monkeypatch.setattr(GraphedStep, "_capture", capture)
    return step, state, attempts


def test_a_failed_capture_is_tried_once_more_then_replayed(monkeypatch):
    step, state, attempts = _counting_step(monkeypatch, failures=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        step(3)
        step(3)
    assert attempts == [3, 3] and step.use_graphs and step.captured == 1
    assert int(state) == 6  # the warm-ups of both attempts left no trace: two steps of 3


def test_two_failed_captures_run_the_step_eagerly_for_good(monkeypatch):
    step, state, attempts = _counting_step(monkeypatch, failures=2)
    with pytest.warns(UserWarning) as caught:
        step(3)
    message = str(caught[0].message)
    assert "decode step for 3 cache positions failed 2 times, running it eagerly" in message
    assert "RuntimeError: operation failed due to a previous error during capture (1); then: " \
           "RuntimeError: operation failed due to a previous error during capture (2)" in message
    assert "more" not in message  # first lines only
    assert not step.use_graphs and int(state) == 3  # the step ran once, eagerly
    step(5)
    assert attempts == [3, 3] and int(state) == 8  # no capture tried again


def test_a_warm_up_that_raises_leaves_the_state_as_it_was():
    state = torch.tensor([7])

    def fn(key):
        state.add_(key)
        if key == 2:
            raise RuntimeError("a warm-up failed after stepping the state")

    step = GraphedStep(fn, [state], use_graphs=True, name="verify")
    with pytest.raises(RuntimeError, match="a warm-up failed"):
        step.warm_up(2)
    assert int(state) == 7
    step.warm_up(1)
    assert int(state) == 7


class _Cycle:
    def __init__(self):
        self.me = self


@pytest.mark.parametrize("collect", [True, False])
@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_runs_before_a_first_capture_and_is_held_off_during_any(enabled, collect, monkeypatch):
    was, calls = gc.isenabled(), []
    if not collect:  # a later key's capture: no full collection (it stalls a job with a big heap)
        monkeypatch.setattr(gc, "collect", lambda *generation: calls.append(generation))
    try:
        gc.enable() if enabled else gc.disable()
        dead = _Cycle()
        alive = weakref.ref(dead)
        del dead
        with pytest.raises(ValueError):
            with quiet_collector(collect=collect):
                assert alive() is None if collect else calls == []  # collected on the way in, if asked
                assert not gc.isenabled()
                raise ValueError
        assert gc.isenabled() == enabled  # as it was, after an error too
    finally:
        gc.enable() if was else gc.disable()
