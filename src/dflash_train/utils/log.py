"""The one logging setup: plain lines on stderr, from the main process only.

Every module logs through `logging.getLogger(__name__)`. `setup_logging` (called once by
the CLI) sends records to stderr through tqdm, so log lines and progress bars do not
overwrite each other. Under torchrun only the main process prints INFO lines (rank 0
until the trainer names its main drafter with `set_main_process`); warnings and errors of
every rank are printed with a `[rank N]` prefix.
"""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

_state = {"main": int(os.environ.get("RANK", "0")) == 0}


def set_main_process(is_main: bool) -> None:
    """Whether this process prints INFO lines (the trainer calls it once roles are known)."""
    _state["main"] = bool(is_main)


class _TqdmHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stderr)
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging must never raise
            self.handleError(record)


class _MainProcessFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or _state["main"]


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and record.levelno >= logging.WARNING:
            text = f"[rank {os.environ.get('RANK', '?')}] {text}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(level: int | str = logging.INFO) -> None:
    """Route every `dflash_train` logger to stderr (idempotent)."""
    root = logging.getLogger("dflash_train")
    root.setLevel(level)
    root.propagate = False
    for handler in list(root.handlers):
        if isinstance(handler, _TqdmHandler):
            root.removeHandler(handler)
    handler = _TqdmHandler()
    handler.setFormatter(_Formatter())
    handler.addFilter(_MainProcessFilter())
    root.addHandler(handler)
