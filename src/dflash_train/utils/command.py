"""How this process was started, to spell the next commands the way the user can run them."""

from __future__ import annotations

import sys
from pathlib import Path


def program() -> str:
    """`dflash-train` as it was called (`.venv/bin/dflash-train`, or `dflash-train` from the PATH), else
    `python -m dflash_train`: a next command spelled so, works in the shell it was started from."""
    return sys.argv[0] if sys.argv and Path(sys.argv[0]).name == "dflash-train" else "python -m dflash_train"
