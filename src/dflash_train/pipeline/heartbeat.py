"""Survivors notice a dead rank themselves: a heartbeat of every rank in the job's store.

A rank that dies (SIGKILL, OOM killer, a crashed node) leaves its peers blocked in a
collective or a transfer. NCCL may wait there far longer than any timeout, and torchrun,
which sees only its own node's processes, ends them with SIGKILL at best, saying nothing
about why; under srun without torchrun, or across nodes, nobody ends them at all.

So every rank runs a daemon thread that, every `pipeline.heartbeat_s`, increments its own
counter in the rendezvous store (torch.distributed's TCPStore, the one torchrun or rank 0
hosts for `init_process_group`, reached through its public client) and reads everyone
else's. A counter that has not moved for `pipeline.dead_rank_timeout_s` means that rank is
dead or frozen: this rank logs which one and exits at once with `EXIT_PEER_LOST`, from the
thread, because its main thread may be stuck in a call that never returns. The thread
needs no cooperation from the main thread, so it works while that one is blocked in NCCL.

Monitoring stops after the job's last collective (`stop`), so ranks that finish at
different moments never mistake a clean exit for a death.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from dflash_train.utils.errors import EXIT_PEER_LOST

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, rank: int, world: int, *, interval_s: float, dead_after_s: float, store=None):
        self.rank, self.world = rank, world
        self.interval_s, self.dead_after_s = interval_s, dead_after_s
        self.where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        self.store_timeout_s = max(interval_s * 2, 5.0)  # the longest one store call can take
        if store is None:  # our own client of the job's store: used only by the thread
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                  timeout=timedelta(seconds=self.store_timeout_s))
        self.store = dist.PrefixStore("dflash-heartbeat", store)
        self.verdict: str | None = None  # why this rank is ending (set once, by the thread)
        self._decided = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="dflash-heartbeat")

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """The job's work is done: stop beating and watching (a peer may now exit at any time)."""
        self._stop.set()
        # wait out a store call in flight: a thread still inside one when the interpreter exits
        # aborts the process ("terminate called without an active exception")
        self._thread.join(timeout=self.store_timeout_s + 2 * self.interval_s)

    def wait_for_verdict(self) -> str | None:
        """After an error in the main thread: give the watchdog the time to name a dead peer
        (it then ends this process); None when every rank kept beating."""
        self._decided.wait(self.dead_after_s + 4 * self.interval_s)
        return self.verdict

    def _run(self) -> None:
        others = [r for r in range(self.world) if r != self.rank]
        counts = dict.fromkeys(others, -1)
        now = time.monotonic()
        moved = dict.fromkeys(others, now)  # when each counter last changed (this rank's clock)
        store_ok, store_error = now, None
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                self.store.add(str(self.rank), 1)
                seen = {r: self.store.add(str(r), 0) for r in others}  # add 0: read without blocking
                store_ok = now
            except Exception as exc:  # noqa: BLE001 - any store failure counts against the deadline
                seen, store_error = {}, exc
            for r, c in seen.items():
                if c != counts[r]:
                    counts[r], moved[r] = c, now
            # a peer that stopped beating is named first, even when the store went down after it
            # (without torchrun rank 0 hosts the store: its survivors lose both)
            # (peers that were still beating when the store went down are not blamed for it)
            failing = now - store_ok > 2 * self.interval_s
            dead = sorted(r for r in others if now - moved[r] > self.dead_after_s
                          and (not failing or moved[r] < store_ok - 2 * self.interval_s))
            if dead:
                names = ", ".join(f"rank {r}" for r in dead)
                self._end(f"{names} sent no heartbeat for {self.dead_after_s:.0f}s (pipeline.dead_rank_timeout_s): "
                          f"dead or frozen")
            elif now - store_ok > self.dead_after_s:
                self._end(f"the job's rendezvous store at {self.where} (hosted by the torchrun agent, or by rank 0 "
                          f"without torchrun) stopped answering {now - store_ok:.0f}s ago: {store_error}")

    def _end(self, why: str) -> None:
        if self._stop.is_set():
            return
        self.verdict = why
        self._decided.set()
        log.error("%s; ending this rank (exit code %d, nothing is saved: resume from the last checkpoint)",
                  why, EXIT_PEER_LOST)
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_PEER_LOST)  # the main thread may be blocked for good: no cleanup can be waited for
