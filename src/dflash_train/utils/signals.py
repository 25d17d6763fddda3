"""Graceful stop requests: SIGINT/SIGTERM set a flag that the loop reads at a step boundary."""

from __future__ import annotations

import logging
import signal
import threading

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
