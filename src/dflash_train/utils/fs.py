"""Filesystem helpers shared by every job that writes results other jobs read."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def atomic_directory_write(final: Path, write_into, *, before_swap=None) -> Path:
    """Run `write_into(tmpdir)`, then move tmpdir to `final` (replacing an older one).

    A crash at any moment leaves either the old directory or the new one, never a half
    written directory under the final name. `before_swap()` runs just before the rename
    (e.g. to re-check that nobody created the destination meanwhile).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        write_into(tmp)
        for f in tmp.rglob("*"):  # make the file contents durable before the rename
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if before_swap is not None:
            before_swap()
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        dir_fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
