"""The one error policy.

A `DFlashError` is a problem the user can fix (a bad config value, a malformed row, a
model that does not fit): `dflash-train` prints its message as one line and exits with
status 2 (`--debug` shows the traceback). Anything else is a bug or an environment
failure and keeps its full traceback. So domain code raises these classes, never bare
ValueError for user input, and the CLI catches only `DFlashError`.
"""

from __future__ import annotations

import errno

EXIT_USER_ERROR = 2  # a DFlashError: fix the input and run again
EXIT_INTERRUPTED = 130  # Ctrl-C before any checkpoint handling (128 + SIGINT)
EXIT_PEER_LOST = 3  # another rank of the job died or froze (pipeline/heartbeat.py); resume from the last checkpoint


class DFlashError(Exception):
    """A problem with the user's input, config, data or models; the message says what to change."""


class ConfigError(DFlashError):
    """A config key or value is invalid; the message names the key and the file."""


class InputError(DFlashError):
    """An input file or directory that does not exist or cannot be read or used."""


class OutputError(DFlashError):
    """An output path that must not be written (exists, holds inputs, not ours)."""


class ModelError(DFlashError):
    """A target or drafter that cannot be found, loaded, or used together."""


class TrainingError(DFlashError):
    """A run that cannot start or continue; the message says why and what to change."""


class EvalError(DFlashError):
    """An evaluation that cannot run: prompts that cannot be used, a drafter that does not fit."""


class DataError(DFlashError):
    """Bad input data; the message names the file, the line (or row) and the field."""

    def __init__(self, file, line: int | None, field_name: str | None, problem: str):
        self.file, self.line, self.field, self.problem = str(file), line, field_name, problem
        where = self.file + (f":{line}" if line is not None else "")
        what = f" field '{field_name}'" if field_name else ""
        super().__init__(f"{where}:{what} {problem}")

    def __reduce__(self):  # picklable, so worker processes can hand bad rows back
        return (type(self), (self.file, self.line, self.field, self.problem))

    def to_dict(self) -> dict:
        where = self.file + (f":{self.line}" if self.line is not None else "")
        return {"where": where, "field": self.field, "reason": self.problem}


# OS errors that are the user's to fix, not bugs: where the outputs go is full, read-only, not ours,
# or a file stands where the output needs a folder.
_STORAGE_FIXES = {
    errno.ENOSPC: "free some space there or choose another output",
    errno.EDQUOT: "free some of your quota there or choose another output",
    errno.EFBIG: "raise the file-size limit (ulimit -f) or choose another output",
    errno.ENOTDIR: "a file stands where the output needs a folder: choose another output",
    errno.EEXIST: "a file stands where the output needs a folder: choose another output",
    errno.EROFS: "choose an output on a writable filesystem",
    errno.EACCES: "fix its permissions or choose another output",
    errno.EPERM: "fix its permissions or choose another output",
}


def storage_error(exc: OSError, output: object = None) -> OutputError | None:
    """A full disk, a read-only filesystem or a permission problem as one line naming the path
    (the error's own, else the job's `output`) and what to do; None for any other OSError."""
    fix = _STORAGE_FIXES.get(exc.errno)
    if fix is None:
        return None
    path = exc.filename or output
    where = f"{path}: " if path else ""
    return OutputError(f"{where}{exc.strerror or exc}: {fix}")
