"""Step-time split without host syncs in the hot loop.

On GPU each stage is bracketed by CUDA events recorded on the current stream; elapsed
times are read only when the log step asks for them (one synchronisation per log
step); spans on another stream that are still running are read at a later log step. On CPU work is synchronous and wall-clock time is exact.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch


class StageTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._pending: list[tuple[str, object, object]] = []
        self.totals: dict[str, float] = defaultdict(float)  # seconds since last reset

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, name: str, begin) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((name, begin, end))
        else:
            self.totals[name] += time.perf_counter() - begin

    def add_host(self, name: str, seconds: float) -> None:
        """A host-side duration (e.g. waiting for the data loader)."""
        self.totals[name] += seconds

    def collect(self) -> dict[str, float]:
        """Seconds per stage since the last call (synchronises once on GPU)."""
        if self._pending:
            self._pending[-1][2].synchronize()
            still_running = []  # events of another stream (the target run ahead: pipeline.overlap_target)
            for name, begin, end in self._pending:
                if end.query():
                    self.totals[name] += begin.elapsed_time(end) / 1000.0
                else:
                    still_running.append((name, begin, end))
            self._pending = still_running
        out = dict(self.totals)
        self.totals.clear()
        return out
