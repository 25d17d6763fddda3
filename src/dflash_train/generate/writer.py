"""Append-only JSONL output that survives being killed at any instant.

- Each flush hands the kernel complete lines in one `os.write` on an O_APPEND descriptor,
  then `fsync`s, so a line on disk is whole unless the process died inside that write.
- On start, `recover` truncates the file to its last newline (a torn tail can only be the
  last, unterminated line) and reports what it dropped; the rows before it are complete.
- Rows are identified by a stable `id`; the driver skips ids already in the file, so a
  resumed run neither repeats nor loses a conversation. Rows buffered but not yet flushed
  when the process dies are simply generated again.
- An exclusive lock on the file stops two runs from appending to it at once.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterator

from dflash_train.utils.errors import DataError, OutputError
from dflash_train.utils.jsonl import iter_jsonl

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no advisory lock
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


class OutputBusyError(OutputError):
    """Another process holds the output file's lock."""


def recover(path: str | Path) -> int:
    """Truncate a torn last line (no trailing newline) of `path`; returns bytes dropped."""
    path = Path(path)
    if not path.exists():
        return 0
    with path.open("r+b") as fh:
        size = fh.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        fh.seek(size - 1)
        if fh.read(1) == b"\n":
            return 0
        keep = 0
        pos = size
        while pos > 0:  # scan backwards for the last newline
            step = min(1 << 16, pos)
            pos -= step
            fh.seek(pos)
            chunk = fh.read(step)
            i = chunk.rfind(b"\n")
            if i >= 0:
                keep = pos + i + 1
                break
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    dropped = size - keep
    log.warning("%s: dropped a torn last line (%d bytes) left by an interrupted run", path, dropped)
    return dropped


def read_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    """The rows of an existing output file (after `recover`). A broken line that is not the
    last cannot come from an interrupted run, so it is an error naming the line."""
    path = Path(path)
    if not path.exists():
        return
    for lineno, row in iter_jsonl(path):
        if isinstance(row, DataError):
            raise DataError(path, lineno, None, f"{row.problem}: not a JSON line of a generate output; "
                                                f"fix or move the file")
        if not isinstance(row, dict) or not isinstance(row.get("id"), str):
            raise DataError(path, lineno, None, "not a generate output row (no string 'id')")
        yield row


class JsonlAppender:
    """Buffered, fsync'ed, locked appends of JSON rows to one file."""

    def __init__(self, path: str | Path, *, flush_rows: int = 32, flush_seconds: float = 5.0) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.flush_rows, self.flush_seconds = max(1, flush_rows), flush_seconds
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if fcntl is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self._fd)
                raise OutputBusyError(f"{self.path} is being written by another generate run") from None
        self._buffer: list[bytes] = []
        self._last_flush = time.monotonic()
        self.written = 0

    def add(self, row: dict[str, Any]) -> None:
        self._buffer.append(json.dumps(row, ensure_ascii=False).encode("utf-8") + b"\n")
        if len(self._buffer) >= self.flush_rows or time.monotonic() - self._last_flush >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        if self._buffer:
            data = b"".join(self._buffer)
            view = memoryview(data)
            while view:  # os.write may write less than asked (rare for files, but allowed)
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
            self.written += len(self._buffer)
            self._buffer.clear()
        self._last_flush = time.monotonic()

    def discard_if_empty(self) -> bool:
        """Remove the file, still under the lock, when nothing was ever written to it (a run that
        failed before its first row and created the file); returns whether it was removed."""
        if self._fd < 0 or self.written or self._buffer or os.fstat(self._fd).st_size:
            return False
        self.path.unlink(missing_ok=True)
        return True

    def close(self) -> None:
        if self._fd < 0:
            return
        try:
            self.flush()
        finally:
            os.close(self._fd)  # also releases the lock
            self._fd = -1

    def __enter__(self) -> "JsonlAppender":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
