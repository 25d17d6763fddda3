"""generate/graphs.py: bucket sizes and the padded prefill chunk rule, against brute force."""

from __future__ import annotations

import random

import pytest

from dflash_train.generate.graphs import PrefillShapes, bucket_of, kv_buckets


def test_buckets_are_powers_of_two_up_to_the_cap():
    assert kv_buckets(2048, smallest=64) == [64, 128, 256, 512, 1024, 2048]
    assert kv_buckets(1000, smallest=64) == [64, 128, 256, 512, 1000]
    assert kv_buckets(20, smallest=64) == [20]
    assert [bucket_of(n, [1, 2, 4, 5]) for n in range(1, 6)] == [1, 2, 4, 4, 5]
    with pytest.raises(ValueError, match="larger than the largest bucket"):
        bucket_of(6, [1, 2, 4, 5])


@pytest.mark.parametrize("seed", range(6))
def test_chunks_are_the_longest_runs_that_fit_the_budget_padded(seed):
    rng = random.Random(seed)
    max_rows, max_width, budget, min_width = rng.choice([(1, 300, 500, 16), (7, 300, 1000, 16), (64, 2048, 16384, 64)])
    shapes = PrefillShapes(max_rows, max_width, budget, min_width)
    lengths = sorted(rng.randint(1, max_width) for _ in range(rng.randint(1, 200)))

    def padded(rows, width):  # brute force: the smallest power of two (or the cap) at or above each
        r = min([2**k for k in range(12) if 2**k >= rows and 2**k < shapes.rows[-1]] + [shapes.rows[-1]])
        w = min([min_width * 2**k for k in range(12) if min_width * 2**k >= width and min_width * 2**k < max_width]
                + [max_width])
        return r, w

    chunks = shapes.chunks(lengths)
    assert [s for s, _ in chunks] == [0] + [e for _, e in chunks[:-1]] and chunks[-1][1] == len(lengths)
    for start, end in chunks:
        rows, width = end - start, lengths[end - 1]
        assert shapes.shape(rows, width) == padded(rows, width)
        pad_rows, pad_width = padded(rows, width)
        assert rows == 1 or (rows <= shapes.rows[-1] and pad_rows * pad_width <= shapes.budget)
        if end < len(lengths):  # one prompt more would not have fitted
            more_rows, more_width = padded(rows + 1, lengths[end]) if rows + 1 <= shapes.rows[-1] else (None, None)
            assert more_rows is None or more_rows * more_width > shapes.budget
