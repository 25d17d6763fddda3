"""The host's bookkeeping per decode step of `generate`, alone: per-slot Python against arrays.

    python dev/experiments/host_bookkeeping.py                      # 1,536 slots, 400 steps
    python dev/experiments/host_bookkeeping.py --slots 256 --steps 200 --out /tmp/hb.json

Between two decode steps the built-in engine (generate/builtin.py) advances every row's
position, hands every slot its token, finds the rows that stop and refills their slots.
On a GPU that host work overlaps the step in flight; once it takes longer than the step,
the GPU waits. This times that work alone (no model: a simulated device), two ways:

* per-slot: the engine's earlier code, transcribed: a Python object per row, a loop over
  every slot at launch (positions; the sampling flags whenever a row came or went) and at
  read-back (`tolist()`, one append per slot), and each prefill's first tokens read at once;
* arrays: generate/slots.py as the engine uses it now (numpy over `[slots]`, Python only
  for finishing rows; first tokens read with the next step).

Both see the same token stream: a row's i-th token is a hash of (row, i), a stop token with
probability 1/`--mean-len` (`--max-new` caps a row), so both must finish every row with the
same tokens; the script checks that. Refills follow the engine's rule (once 1/8 of the
slots are free). Not timed, as the same in both: the tokenizer's decode of a finished row
and the completion callback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dflash_train.generate.sampling import Sampling
from dflash_train.generate.slots import SlotTable

STOP = 2


@dataclass(eq=False)
class _Row:
    tag: int
    limit: int
    next_pos: int
    out: list[int] = field(default_factory=list)
    sampling: Sampling = Sampling()


class PerSlot:
    """The engine's bookkeeping before generate/slots.py (BuiltinEngine._launch/_collect/_append)."""

    def __init__(self, slots: int, max_new: int) -> None:
        self.rows: list[_Row | None] = [None] * slots
        self.free = list(range(slots - 1, -1, -1))
        self.dirty, self.flags = False, (False, False)

    def admit(self, tags: list[int], prompt_lens: list[int], limit: int, firsts: list[int], done: dict) -> None:
        slots = [self.free.pop() for _ in tags]
        for slot, tag, prompt_len in zip(slots, tags, prompt_lens):
            self.rows[slot] = _Row(tag, limit, prompt_len)
        self.dirty = True
        for slot, first in zip(slots, firsts):  # the first tokens were read at the prefill (a sync)
            self._append(slot, first, done)

    def launch(self) -> tuple:
        if self.dirty:  # the sampling flags, recomputed before the step's token selection
            self.dirty = False
            samplings = [row.sampling for row in self.rows if row is not None]
            self.flags = (any(not x.greedy for x in samplings),
                          any(not x.greedy and (x.top_k > 0 or x.top_p < 1.0) for x in samplings))
        rows = list(self.rows)
        active = [s for s, row in enumerate(rows) if row is not None]
        kv_needed = 1 + max(rows[s].next_pos for s in active)  # type: ignore[union-attr]
        for s in active:
            rows[s].next_pos += 1  # type: ignore[union-attr]
        return kv_needed, rows, active

    def collect(self, launched: tuple, tokens: torch.Tensor, first: torch.Tensor, done: dict) -> None:
        _, rows, active = launched
        host = tokens.tolist()
        for slot in active:
            if self.rows[slot] is rows[slot]:
                self._append(slot, host[slot], done)

    def _append(self, slot: int, token: int, done: dict) -> None:
        row = self.rows[slot]
        stop = token == STOP
        if not stop:
            row.out.append(token)
        if stop or len(row.out) >= row.limit:
            self.rows[slot] = None
            self.free.append(slot)
            self.dirty = True
            done[row.tag] = (row.out, "stop" if stop else "length")


class Arrays:
    """The engine's bookkeeping now: generate/slots.py, first tokens read with the next step."""

    def __init__(self, slots: int, max_new: int) -> None:
        self.table = SlotTable(slots, max_new, {STOP})
        self.free = self.table.free
        self.tags: list[int | None] = [None] * slots
        self.fresh: list[int] = []
        self.n_sampled = self.n_filtered = 0

    def _count(self, s: Sampling, sign: int) -> None:  # BuiltinEngine._count_sampling
        self.n_sampled += sign * (not s.greedy)
        self.n_filtered += sign * (not s.greedy and (s.top_k > 0 or s.top_p < 1.0))

    def admit(self, tags: list[int], prompt_lens: list[int], limit: int, firsts: list[int], done: dict) -> None:
        for tag, prompt_len in zip(tags, prompt_lens):
            slot = self.table.occupy(prompt_len, limit)
            self.tags[slot] = tag
            self.fresh.append(slot)
            self._count(Sampling(), 1)

    def launch(self) -> tuple:
        kv_needed, owners = self.table.launch()
        fresh, self.fresh = self.fresh, []
        first_owners = None
        if fresh:
            first_owners = np.full(self.table.slots, -1, dtype=np.int64)
            first_owners[fresh] = owners[fresh]
        return kv_needed, owners, first_owners

    def collect(self, launched: tuple, tokens: torch.Tensor, first: torch.Tensor, done: dict) -> None:
        _, owners, first_owners = launched
        if first_owners is not None:
            self._deliver(first.numpy(), first_owners, done)
        self._deliver(tokens.numpy(), owners, done)

    def _deliver(self, tokens: np.ndarray, owners: np.ndarray, done: dict) -> None:
        ended, stopped = self.table.take(tokens, owners)
        for slot, stop in zip(ended.tolist(), stopped.tolist()):
            done[self.tags[slot]] = (self.table.release(slot), "stop" if stop else "length")
            self._count(Sampling(), -1)
            self.tags[slot] = None


def token(tags: np.ndarray, i: np.ndarray, mean_len: int, vocab: int) -> np.ndarray:
    """The i-th token of rows `tags`: STOP with probability 1/mean_len, else a hashed id."""
    h = (tags * 0x9E3779B1 + i * 0x85EBCA6B + 12345) & 0xFFFFFFFF
    h = ((h >> 15) ^ h) * 0x2C1B3C6D & 0xFFFFFFFF
    h = (h >> 13) ^ h
    return np.where(h % mean_len == 0, STOP, 3 + (h >> 8) % (vocab - 3))


def simulate(book, args) -> tuple[float, dict, int]:
    """Run `book` for `args.steps` steps in the engine's order (admit, launch t, collect t-1);
    returns the seconds spent in the book's bookkeeping, the finished rows, the rows admitted."""
    slots, rng = args.slots, np.random.default_rng(0)
    dev_tag, dev_i = np.zeros(slots, dtype=np.int64), np.zeros(slots, dtype=np.int64)  # the simulated device
    done: dict = {}
    pending, tags, spent = None, 0, 0.0
    for _ in range(args.steps):
        if len(book.free) >= max(1, slots // 8):
            new = list(reversed(book.free))  # the slots `admit` pops, in order
            row_tags = list(range(tags, tags + len(new)))
            firsts = token(np.array(row_tags), np.zeros(len(new), dtype=np.int64), args.mean_len, args.vocab).tolist()
            prompt_lens = rng.integers(16, 512, len(new)).tolist()
            t0 = time.perf_counter()
            book.admit(row_tags, prompt_lens, args.max_new, firsts, done)
            spent += time.perf_counter() - t0
            dev_tag[new], dev_i[new] = np.arange(tags, tags + len(new)), 1
            tags += len(new)
        first = torch.from_numpy(token(dev_tag, np.zeros_like(dev_i), args.mean_len, args.vocab))
        step = torch.from_numpy(token(dev_tag, dev_i, args.mean_len, args.vocab))
        dev_i += 1
        t0 = time.perf_counter()
        launched = book.launch()
        if pending is not None:
            book.collect(*pending, done)
        spent += time.perf_counter() - t0
        pending = (launched, step, first)
    book.collect(*pending, done)
    return spent, done, tags


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--slots", type=int, default=1536)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--max-new", type=int, default=512, help="a row's token limit")
    p.add_argument("--mean-len", type=int, default=300, help="1 / the chance of a stop token")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--repeats", type=int, default=3, help="runs of each; the fastest counts")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result: dict = {"slots": args.slots, "steps": args.steps, "max_new": args.max_new, "mean_len": args.mean_len}
    finished = {}
    for name, cls in (("per_slot", PerSlot), ("arrays", Arrays)):
        runs = [simulate(cls(args.slots, args.max_new), args) for _ in range(args.repeats)]
        seconds = min(r[0] for r in runs)
        finished[name] = runs[0][1]
        result[name] = {"us_per_step": 1e6 * seconds / args.steps, "rows_admitted": runs[0][2],
                        "rows_finished": len(runs[0][1])}
    common = finished["per_slot"].keys() & finished["arrays"].keys()
    result["same_tokens"] = all(finished["per_slot"][t] == finished["arrays"][t] for t in common)
    result["rows_compared"] = len(common)
    result["speedup"] = result["per_slot"]["us_per_step"] / result["arrays"]["us_per_step"]
    print(f"host bookkeeping per decode step, {args.slots} slots, {args.steps} steps (fastest of {args.repeats}):")
    for name in ("per_slot", "arrays"):
        r = result[name]
        print(f"  {name:<9} {r['us_per_step']:9.1f} us/step   rows admitted {r['rows_admitted']}, finished "
              f"{r['rows_finished']}")
    print(f"  speed-up {result['speedup']:.1f}x; the {len(common)} rows both finished have the same tokens: "
          f"{result['same_tokens']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["same_tokens"] else 1)
