"""The built-in engine's host-side slot bookkeeping, kept in arrays.

At 1,536 slots a decode step takes a few milliseconds on the GPU, so per-slot Python on the
host (a loop over every slot to advance positions, another to hand each its token) costs
as much as the step itself. Here every per-step operation is a handful of numpy calls over
`[slots]` arrays; Python touches only the rows that finish.

A row is known by a number unique over the run (`row`, -1 for a free slot). The engine reads
a step's tokens one step late, so it keeps the row numbers a step was launched with
(`owners`): a slot whose row has finished (and may hold a new one) since then does not match,
and its token is dropped.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


class SlotTable:
    """Per-slot state of the running rows: position, token limit and the tokens written so far."""

    def __init__(self, slots: int, max_new_tokens: int, stop_ids: Iterable[int] = ()) -> None:
        self.slots = slots
        self.row = np.full(slots, -1, dtype=np.int64)  # the row in each slot, -1: free
        self.next_pos = np.zeros(slots, dtype=np.int64)  # position of each row's next decode input
        self.limit = np.zeros(slots, dtype=np.int64)
        self.count = np.zeros(slots, dtype=np.int64)  # tokens each row has written
        self.tokens = np.zeros((slots, max_new_tokens), dtype=np.int32)  # token ids < 2**31
        self._flat = self.tokens.reshape(-1)  # a view: row s, token i at s * max_new_tokens + i
        self.stop_ids = np.array(sorted(stop_ids), dtype=np.int64)
        self.free: list[int] = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._rows = 0

    @property
    def n_active(self) -> int:
        return self.slots - len(self.free)

    def occupy(self, prompt_len: int, limit: int) -> int:
        """Put a new row (its prompt prefilled, at most `limit` new tokens) in a free slot; returns the slot."""
        if not 1 <= limit <= self.tokens.shape[1]:
            raise ValueError(f"limit {limit} is outside [1, {self.tokens.shape[1]}]")
        slot = self.free.pop()
        self.row[slot], self._rows = self._rows, self._rows + 1
        self.next_pos[slot], self.limit[slot], self.count[slot] = prompt_len, limit, 0
        return slot

    def launch(self) -> tuple[int, np.ndarray]:
        """A decode step is launched for every row: the cache positions it reads (1 + the
        largest input position) and the rows it was launched for (`owners` of `take`)."""
        active = self.row >= 0
        kv_needed = 1 + int(self.next_pos.max(where=active, initial=-1))
        self.next_pos += active
        return kv_needed, self.row.copy()

    def take(self, tokens: np.ndarray, owners: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Hand `tokens[s]` to the row in slot s if it is `owners[s]` (still there since launch).
        A stop token ends its row (and is not kept), as does reaching the limit. Returns the
        slots whose rows end (ascending) and, for each, whether it was a stop token."""
        live = np.flatnonzero((owners == self.row) & (owners >= 0))
        tok = tokens[live]
        stop = self._is_stop(tok)
        n = self.count[live]
        self._flat[live * self.tokens.shape[1] + n] = tok  # a stop token lands past the row's end: never read
        n += ~stop
        self.count[live] = n
        done = stop | (n >= self.limit[live])
        return live[done], stop[done]

    def _is_stop(self, tok: np.ndarray) -> np.ndarray:
        if len(self.stop_ids) > 4:
            return np.isin(tok, self.stop_ids)
        stop = np.zeros(len(tok), dtype=bool)  # a few stop ids: comparisons beat isin's sort
        for s in self.stop_ids.tolist():
            stop |= tok == s
        return stop

    def release(self, slot: int) -> list[int]:
        """Free `slot`; returns its row's tokens."""
        out = self.tokens[slot, : self.count[slot]].tolist()
        self.row[slot], self.next_pos[slot] = -1, 0
        self.free.append(slot)
        return out
