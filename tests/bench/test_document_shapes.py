"""bench/document_shapes.py: the replayed plan's shapes and rounding costs, on plans worked out by hand."""

import numpy as np
import pytest

from dflash_train.data.batching import BatchPlanConfig

from .scripts import load_script

document_shapes = load_script("bench/document_shapes.py")


def _plan(**kw):
    return BatchPlanConfig(shuffle=False, num_buckets=1, **kw)


def test_one_row_batches_by_hand():
    # rows of 8 tokens, one row a batch, in order: [0, 1] (3+5), [2] alone (7 does not fit 2),
    # [3, 4] (7+1), [5] alone: two gathering batches, (2, 5) and (2, 7), each epoch
    lengths = np.array([3, 5, 2, 7, 1, 4])
    got = document_shapes.replay(lengths, _plan(token_budget=8, row_tokens=8), epochs=2)
    assert got["steps"] == 8 and got["gathering_steps"] == 4
    assert got["distinct_shapes"] == {"raw": 2, "rounded": 2}
    assert got["new_shapes_per_epoch"] == {"raw": [2, 0], "rounded": [2, 0]}
    assert got["rounding_extra_slots"] == 0 and got["rounding_extra_attention_work"] == 0


def test_rounding_merges_shapes_and_costs_what_it_pads():
    # two rows of 24 tokens a batch: [17, 3] + [20] -> (3, 20); [19, 1] + [18] -> (3, 19)
    lengths = np.array([17, 3, 20, 19, 1, 18])
    got = document_shapes.replay(lengths, _plan(token_budget=48, row_tokens=24), epochs=1)
    assert got["distinct_shapes"] == {"raw": 2, "rounded": 1}  # L 20 and 19 both round to 20
    assert got["rounding_extra_slots"] == pytest.approx((3 * 20 + 3 * 20) / (3 * 20 + 3 * 19) - 1)
    assert got["rounding_extra_attention_work"] == pytest.approx((2 * 3 * 400) / (3 * 400 + 3 * 361) - 1)
