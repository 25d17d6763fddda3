"""Filesystem helpers shared by every job that writes results other jobs read.

Three promises, so that nothing is ever lost:

* an output is replaced only when asked (`--overwrite`) and only when it is ours: a
  directory holding the marker file `.dflash-train` (written into every directory a job
  creates), never a plain file, never one that holds the job's own inputs
  (`check_output_dir`);
* a crash leaves the old version or the new one, never half of one, and the leftovers of
  a killed writer are removed by the next run (`atomic_directory_write`);
* what the tool creates gets the modes the process umask gives (0755/0644 under umask 022),
  so another account (a serving job) can read datasets, checkpoints and drafters.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from dflash_train.utils.errors import OutputError

log = logging.getLogger(__name__)

MARKER = ".dflash-train"  # holds the name of the job that wrote the directory

# A temp directory names its writer: `.NAME.tmp-PID@HOST-RANDOM`, and the previous version
# parked during a replacement `.NAME.old-PID@HOST`. Put in the name, not in a file inside,
# so there is no moment at which a writer's directory exists without saying whose it is.
_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"
_LEFTOVER = r"^\.(?P<name>{name})\.(?P<kind>tmp|old)-(?P<pid>\d+)@(?P<host>[A-Za-z0-9._-]+?)(?:-[0-9a-f]{{8}})?$"


# -- what a path is --------------------------------------------------------------------------------


def missing_reason(path: str | Path, *, want: str = "file") -> str:
    """Why `path` is not the `want` ("file" or "folder") a job was given, in a few words: not found,
    a loop of symbolic links, a link to nothing, a folder where a file is needed (or the other way)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a loop of symbolic links"
        if path.is_symlink():
            return f"a symbolic link to {os.readlink(path)!r}, which does not exist"
        if exc.errno == errno.ENOTDIR:
            return "not found (a file stands where the path needs a folder)"
        if exc.errno in (errno.EACCES, errno.EPERM):
            return "not readable: permission denied"
        return "not found"
    if want == "file" and stat.S_ISDIR(st.st_mode):
        return "a folder, not a file"
    if want == "folder" and not stat.S_ISDIR(st.st_mode):
        return "a file, not a folder"
    return "not usable"


def not_usable(kind: str, path: str | Path, *, want: str = "file") -> str:
    """`KIND not found: PATH`, or `KIND PATH: why` when the path is there but not usable (missing_reason)."""
    why = missing_reason(path, want=want)
    return f"{kind} not found: {path}" if why == "not found" else f"{kind} {path}: {why}"


# -- ownership ---------------------------------------------------------------------------------


def write_marker(directory: Path, job: str) -> None:
    """Mark `directory` as made by dflash-train `job` (what `check_output_dir` looks for)."""
    (Path(directory) / MARKER).write_text(job + "\n")


def made_by(directory: Path) -> str | None:
    """The job named in the directory's marker file, or None for a directory we did not make."""
    try:
        return (Path(directory) / MARKER).read_text().strip() or None
    except OSError:
        return None


def check_output_dir(path: str | Path, *, overwrite: bool, inputs: Iterable[str | Path], job: str) -> Path:
    """Refuse an output that must not be written; returns it resolved. Call before writing.

    A missing path or an empty directory is fine. An existing one is replaced only with
    `overwrite` and only when it is a directory that dflash-train `job` made (marker file).
    Never replaced, whatever `overwrite` says: a plain file, and a path that is an input,
    holds an input, or lies inside an input directory (paths compared resolved).
    Raises OutputError saying why and what to do.
    """
    out = Path(path).expanduser().resolve()
    if not out.exists():
        return out
    _refuse_inputs(out, inputs, job)
    if not out.is_dir():
        raise OutputError(f"{out} is a file, not a directory: {job} never replaces a file; choose another output")
    if not any(out.iterdir()):
        return out
    if not overwrite:
        raise OutputError(f"{out} already exists; pass --overwrite to replace it")
    owner = made_by(out)
    if owner is None:
        raise OutputError(f"{out} was not made by dflash-train (it has no {MARKER} file): not replacing it, "
                          f"even with --overwrite; delete it yourself or choose another output")
    if owner != job:
        raise OutputError(f"{out} holds the output of dflash-train {owner}, not {job}: not replacing it; "
                          f"delete it yourself or choose another output")
    return out


def _refuse_inputs(out: Path, inputs: Iterable[str | Path], job: str) -> None:
    for given in inputs:
        src = Path(given).expanduser().resolve()
        if src == out or src.is_relative_to(out):
            raise OutputError(f"{out} holds an input of this {job} job ({src}): it is never replaced; "
                              f"choose another output")
        if out.is_relative_to(src):
            raise OutputError(f"{out} is inside the input directory {src}: it is never replaced; "
                              f"choose an output outside the inputs")


def _is_ours_to_replace(final: Path, new_names: set[str]) -> bool:
    """A directory we may rename away: marked by us, empty, or holding only names the new
    version writes too (an earlier version of the same output, e.g. written before markers)."""
    if made_by(final) is not None:
        return True
    return {p.name for p in final.iterdir()} <= new_names


# -- leftovers of killed writers ------------------------------------------------------------------


def writer_tag() -> str:
    """`PID@HOST` of this process, as it appears in the names of its temp directories."""
    return f"{os.getpid()}@{_HOST}"


def _writer_is_alive(pid: int, host: str) -> bool:
    if host != _HOST:
        return True  # another machine's writer (a shared filesystem): we cannot tell, so keep it
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, under another user
    return True


def remove_stale_temp_dirs(parent: Path, name: str | None = None) -> list[Path]:
    """Clean up after writers that died (SIGKILL, OOM kill, power loss) in `parent`.

    Removes `.NAME.tmp-PID@HOST-*` directories whose PID is not alive on this host, and for
    a `.NAME.old-PID@HOST` (a writer killed between the two renames of a replacement) puts
    the previous version back under NAME when nothing took its place, else removes it.
    `name` limits this to leftovers of one final name; None takes all. A live writer's
    directories and those of other hosts are never touched. Returns the paths handled.
    """
    parent = Path(parent)
    pattern = re.compile(_LEFTOVER.format(name=re.escape(name) if name is not None else ".+"))
    handled = []
    try:
        entries = list(parent.iterdir())
    except FileNotFoundError:
        return []
    for entry in entries:
        m = pattern.match(entry.name)
        if m is None or _writer_is_alive(int(m["pid"]), m["host"]):
            continue
        final = parent / m["name"]
        if m["kind"] == "old" and not final.exists():
            try:
                os.replace(entry, final)
            except OSError:  # another run got there first
                continue
            log.warning("put back %s: its writer (pid %s) died while replacing it", final, m["pid"])
        else:
            shutil.rmtree(entry, ignore_errors=True)
            log.warning("removed %s, left by a writer (pid %s) that died", entry, m["pid"])
        handled.append(entry)
    return handled


# -- atomic writes -------------------------------------------------------------------------------


def make_dir(parent: Path, prefix: str) -> Path:
    """A new uniquely named directory, like tempfile.mkdtemp but with the umask's mode:
    mkdtemp makes 0700, which a directory renamed into place would keep."""
    while True:
        path = Path(parent) / f"{prefix}{secrets.token_hex(4)}"
        try:
            os.mkdir(path, 0o777)  # the kernel applies the umask
            return path
        except FileExistsError:
            continue


def atomic_directory_write(final: Path, write_into: Callable[[Path], None], *, job: str | None = None,
                           before_swap: Callable[[], None] | None = None) -> Path:
    """Run `write_into(tmpdir)`, then rename tmpdir to `final` (replacing an older one).

    A crash at any moment leaves either the old directory or the new one, never a half
    written directory under the final name (killed between the two renames of a
    replacement, the old one is left as `.NAME.old-PID@HOST` and the next run puts it
    back). The temp directory is `.NAME.tmp-PID@HOST-*`:
    first, stale temp directories of the same final name left by dead writers are removed
    (`remove_stale_temp_dirs`); a live concurrent writer's are left alone. With `job`, the
    marker file naming it is written into the new directory. An existing `final` is
    replaced only when it is ours (marked, empty, or holding only names the new version
    writes); a plain file or a foreign directory raises OutputError and is left as it is.
    `before_swap()` runs just before the rename (e.g. to re-check that nobody created the
    destination meanwhile). Directories and files get the modes the umask gives.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(final.parent, final.name)
    if final.exists() and not final.is_dir():
        raise OutputError(f"{final} is a file, not a directory: not replacing it; choose another output")
    tmp = make_dir(final.parent, f".{final.name}.tmp-{writer_tag()}-")
    try:
        if job is not None:
            write_marker(tmp, job)
        write_into(tmp)
        _settle(tmp)
        if before_swap is not None:
            before_swap()
        _swap_into_place(tmp, final)
        _fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _swap_into_place(tmp: Path, final: Path) -> None:
    if not final.exists():
        os.replace(tmp, final)
        return
    if not final.is_dir() or not _is_ours_to_replace(final, {p.name for p in tmp.iterdir()}):
        raise OutputError(f"{final} exists and was not made by dflash-train: not replacing it; "
                          f"delete it yourself or choose another output")
    old = final.with_name(f".{final.name}.old-{writer_tag()}")
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _settle(directory: Path) -> None:
    """Before the rename publishes them: give everything under `directory` the modes the
    umask gives (some writers ignore it: safetensors creates files 0600), and make the file
    contents durable. `directory` itself was made by `make_dir`, so its mode is the umask's."""
    dir_mode = stat.S_IMODE(directory.stat().st_mode) & 0o777
    file_mode = dir_mode & 0o666
    for p in directory.rglob("*"):
        if p.is_symlink():
            continue
        if p.is_dir():
            os.chmod(p, dir_mode)
        elif p.is_file():
            os.chmod(p, file_mode)
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())


def _fsync_dir(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def check_writable_dir(path: str | Path) -> Path:
    """Create `path` if needed and check that files can be written in it, before any long work
    whose results would go there; OutputError otherwise."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path} is a file, not a directory; choose another directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{writer_tag()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise OutputError(f"{path}: cannot write there ({exc.strerror}); choose another directory or fix its "
                          f"permissions") from None
    return path


def check_writable_file(path: str | Path, *, option: str) -> Path:
    """Before long work whose result goes to the file `path` (given by `option`): not a
    directory, and a file can be written in its directory (created if needed); OutputError."""
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"{option} {path} is a directory; give a file name, e.g. {path / 'result.json'}")
    check_writable_dir(path.parent)
    return path


# -- one writer per directory ----------------------------------------------------------------------

LOCK = ".dflash-train.lock"  # in a directory one process at a time writes into (a training run)


@contextlib.contextmanager
def exclusive_directory(path: str | Path, *, job: str, option: str) -> Iterator[Path]:
    """Hold `path` (created if needed) for this process alone while the block runs.

    An flock on the file LOCK inside it: the kernel drops the lock when its holder ends, however
    it ends (SIGKILL, OOM kill), so a killed run never leaves a stale lock behind. The file
    names the holder (`PID@HOST`), so a second process is refused with a line naming it and
    `option` (where to choose another directory). OutputError when it is held or cannot be made.
    """
    path = Path(path)
    made = not path.exists()
    try:
        path.mkdir(parents=True, exist_ok=True)
        fh = open(path / LOCK, "a+")
    except OSError as exc:
        raise OutputError(f"{path}: cannot write there ({exc.strerror}); choose another {option} or fix its "
                          f"permissions") from None
    try:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "a process that has not yet written its id"
            raise OutputError(f"{path} is in use by another dflash-train {job} (pid {holder}): wait for it to end, "
                              f"or choose another {option}") from None
        fh.seek(0)
        fh.truncate()
        fh.write(writer_tag() + "\n")
        fh.flush()
        yield path
    finally:
        if made:  # a folder this run made and left empty (it failed before writing): not left behind
            _remove_if_only_lock(path)
        fh.close()  # closing drops the lock; the file stays otherwise (removing it would race a waiting starter)


def _remove_if_only_lock(path: Path) -> None:
    try:
        if os.listdir(path) == [LOCK]:
            (path / LOCK).unlink()
            path.rmdir()
    except OSError:  # another process wrote there meanwhile: the folder is not only ours
        pass
