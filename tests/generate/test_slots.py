"""The engine's array bookkeeping (generate/slots.py) against a per-slot Python reference."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_train.generate.slots import SlotTable


class _Reference:
    """The bookkeeping written row by row, the obvious way."""

    def __init__(self, slots: int, stop_ids: set[int]) -> None:
        self.rows: list[dict | None] = [None] * slots
        self.stop_ids = stop_ids

    def occupy(self, slot: int, row: int, prompt_len: int, limit: int) -> None:
        self.rows[slot] = {"id": row, "pos": prompt_len, "limit": limit, "out": []}

    def launch(self) -> tuple[int, list[int]]:
        live = [r for r in self.rows if r is not None]
        kv = 1 + max(r["pos"] for r in live)
        for r in live:
            r["pos"] += 1
        return kv, [-1 if r is None else r["id"] for r in self.rows]

    def take(self, tokens: list[int], owners: list[int]) -> list[tuple[int, bool, list[int]]]:
        ended = []
        for slot, (token, owner) in enumerate(zip(tokens, owners)):
            row = self.rows[slot]
            if row is None or row["id"] != owner:
                continue
            stop = token in self.stop_ids
            if not stop:
                row["out"].append(token)
            if stop or len(row["out"]) >= row["limit"]:
                ended.append((slot, stop, row["out"]))
                self.rows[slot] = None
        return ended


@pytest.mark.parametrize("seed,stop_ids", [(0, {3, 5}), (1, {3, 5}), (2, {3}), (3, {0, 3, 5, 7, 8, 11})])
def test_table_equals_the_per_slot_reference(seed, stop_ids):
    """Random runs like the engine's: rows admitted into free slots with limits from 1 up, a
    step's tokens handed over one step late (after the next launch), the first tokens of
    freshly admitted rows before them, stop tokens common (a vocabulary of 12; a few stop ids
    are compared one by one, more go through np.isin)."""
    rng = np.random.default_rng(seed)
    slots, max_new = 7, 6
    table, ref = SlotTable(slots, max_new, stop_ids), _Reference(slots, stop_ids)
    ended_total = first_token_stops = stale = 0
    pending = None
    for _ in range(60):
        fresh = []
        for _ in range(int(rng.integers(0, len(table.free) + 1))):
            prompt_len, limit = int(rng.integers(1, 9)), int(rng.integers(1, max_new + 1))
            slot = table.occupy(prompt_len, limit)
            ref.occupy(slot, int(table.row[slot]), prompt_len, limit)
            fresh.append(slot)
        if table.n_active == 0:
            continue
        kv, owners = table.launch()
        kv_ref, owners_ref = ref.launch()
        assert (kv, owners.tolist()) == (kv_ref, owners_ref)
        first = rng.integers(0, 12, slots)
        first_owners = np.full(slots, -1)
        first_owners[fresh] = owners[fresh]
        launched = (rng.integers(0, 12, slots), owners, first, first_owners)
        if pending is not None:
            tokens, step_owners, first, first_owners = pending
            for toks, own in ((first, first_owners), (tokens, step_owners)):
                stale += int(((own >= 0) & (own != table.row) & (table.row >= 0)).sum())
                want = ref.take(toks.tolist(), own.tolist())
                slots_ended, stopped = table.take(toks, own)
                got = [(s, bool(st), table.release(s)) for s, st in zip(slots_ended.tolist(), stopped.tolist())]
                assert got == want
                ended_total += len(got)
                first_token_stops += sum(st and not out for _, st, out in got)
        pending = launched
    assert ended_total > 50 and first_token_stops > 3 and stale > 3  # every case was met


def test_occupy_refuses_a_limit_the_table_cannot_hold():
    table = SlotTable(2, 4)
    with pytest.raises(ValueError, match="limit 5"):
        table.occupy(3, 5)
    assert table.occupy(3, 4) == 0 and table.n_active == 1
