"""Graceful stop requests: SIGINT/SIGTERM set a flag that the loop reads at a step boundary."""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)


class StopSignals:
    """Context manager: while active, SIGINT and SIGTERM only record their name in `.received`.

    A second SIGINT (Ctrl-C twice) raises KeyboardInterrupt at once when `second_ctrl_c_aborts`.
    Outside the main thread signals cannot be handled, so nothing is installed there.
    The previous handlers are restored on exit.
    """

    def __init__(self, *, announce: str | None = None, second_ctrl_c_aborts: bool = True):
        self.received: str | None = None
        self.announce = announce
        self.second_ctrl_c_aborts = second_ctrl_c_aborts
        self._previous: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT and self.second_ctrl_c_aborts:
            raise KeyboardInterrupt
        first = self.received is None
        self.received = self.received or signal.Signals(signum).name
        if first and self.announce:
            log.info("\n%s received: %s", self.received, self.announce)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class Terminated(KeyboardInterrupt):
    """SIGTERM under `sigterm_interrupts`: unwinds like Ctrl-C (clean-up runs), exit status 143."""

    exit_code = 128 + signal.SIGTERM


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While active, SIGTERM raises `Terminated` where the job is, as Ctrl-C raises KeyboardInterrupt, so
    a short job that writes one output (export) removes its temporary files and says why it stopped;
    without it SIGTERM ends the process at once, silently. Only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
