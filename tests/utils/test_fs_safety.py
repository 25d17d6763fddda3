"""Outputs are replaced only when asked and only when ours; leftovers of killed writers go;
modes follow the umask (utils/fs.py, and its use by prepare)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.data.dataset import TokenDataset
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.utils.errors import OutputError
from dflash_train.utils.fs import (
    MARKER,
    atomic_directory_write,
    check_output_dir,
    made_by,
    remove_stale_temp_dirs,
    writer_tag,
)

from ..conftest import build_tokenizer, synthetic_conversations


def dead_pid() -> int:
    """The PID of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def host() -> str:
    return writer_tag().split("@", 1)[1]


def write_file(name: str, text: str):
    return lambda d: (d / name).write_text(text)


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# -- check_output_dir ----------------------------------------------------------------------------


def test_missing_or_empty_output_is_fine(tmp_path):
    assert check_output_dir(tmp_path / "new", overwrite=False, inputs=[], job="prepare") == tmp_path / "new"
    (tmp_path / "empty").mkdir()
    assert check_output_dir(tmp_path / "empty", overwrite=False, inputs=[], job="prepare") == tmp_path / "empty"


def test_existing_output_is_replaced_only_with_overwrite_and_only_when_ours(tmp_path):
    ours = atomic_directory_write(tmp_path / "ours", write_file("a.txt", "x"), job="prepare")
    assert made_by(ours) == "prepare"
    with pytest.raises(OutputError, match="--overwrite"):
        check_output_dir(ours, overwrite=False, inputs=[], job="prepare")
    assert check_output_dir(ours, overwrite=True, inputs=[], job="prepare") == ours
    with pytest.raises(OutputError, match="output of dflash-train prepare, not export"):
        check_output_dir(ours, overwrite=True, inputs=[], job="export")

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=f"not made by dflash-train .*{MARKER}.*delete it yourself"):
        check_output_dir(foreign, overwrite=True, inputs=[], job="prepare")


def test_a_plain_file_is_never_replaced(tmp_path):
    f = tmp_path / "out"
    f.write_text("precious")
    with pytest.raises(OutputError, match="is a file"):
        check_output_dir(f, overwrite=True, inputs=[], job="export")
    with pytest.raises(OutputError, match="is a file"):
        atomic_directory_write(f, write_file("a.txt", "new"))
    assert f.read_text() == "precious" and hidden(tmp_path) == []  # not renamed away to a hidden name


@pytest.mark.parametrize("case", ["equal", "holds input file", "holds input dir", "inside input dir"])
def test_output_that_is_holds_or_lies_in_an_input_is_never_replaced(tmp_path, case):
    proj = atomic_directory_write(tmp_path / "proj", lambda d: (d / "raw").mkdir() or (d / "raw" / "c.jsonl")
                                  .write_text("{}\n"), job="prepare")  # even one of ours
    raw = proj / "raw"
    output, inputs = {"equal": (raw, [raw]), "holds input file": (proj, [raw / "c.jsonl"]),
                      "holds input dir": (proj, [raw]), "inside input dir": (raw, [proj])}[case]
    with pytest.raises(OutputError, match="input"):
        check_output_dir(output, overwrite=True, inputs=inputs, job="prepare")
    with pytest.raises(OutputError, match="input"):  # the same through a relative or unresolved path
        check_output_dir(output / ".." / output.name, overwrite=True, inputs=[os.path.relpath(p) for p in inputs],
                         job="prepare")


# -- atomic_directory_write ----------------------------------------------------------------------


def test_atomic_write_never_renames_away_a_foreign_directory(tmp_path):
    target = tmp_path / "d"
    target.mkdir()
    (target / "user.txt").write_text("mine")
    with pytest.raises(OutputError, match="not made by dflash-train"):
        atomic_directory_write(target, write_file("a.txt", "new"))
    assert [p.name for p in target.iterdir()] == ["user.txt"] and hidden(tmp_path) == []


def test_atomic_write_replaces_ours_and_earlier_versions(tmp_path):
    marked = atomic_directory_write(tmp_path / "m", write_file("a.txt", "old"), job="export")
    atomic_directory_write(marked, write_file("b.txt", "new"), job="export")
    assert sorted(p.name for p in marked.iterdir()) == [MARKER, "b.txt"]
    unmarked = atomic_directory_write(tmp_path / "u", write_file("a.txt", "old"))  # e.g. written before markers
    atomic_directory_write(unmarked, write_file("a.txt", "new"))  # every old name is rewritten: nothing lost
    assert (unmarked / "a.txt").read_text() == "new" and hidden(tmp_path) == []


KILLED_WRITER = """
import os, signal, sys
from pathlib import Path
from dflash_train.utils.fs import atomic_directory_write
def write(d):
    (d / "shard-00000.arrow").write_bytes(b"partial")
    os.kill(os.getpid(), getattr(signal, sys.argv[2]))
atomic_directory_write(Path(sys.argv[1]), write)
"""


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_next_run_removes_temp_dirs_of_killed_writers(tmp_path, sig):
    final = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(final), sig], env=env, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == -getattr(signal, sig), err
    left = hidden(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".out.tmp-{proc.pid}@") and not final.exists()

    live = tmp_path / f".out.tmp-{os.getpid()}@{host()}-0badc0de"  # a concurrent writer still at work
    other_host = tmp_path / f".out.tmp-{dead_pid()}@some-other-host-0badc0de"  # can't tell: keep
    before_pids = tmp_path / ".out.tmp-a1b2c3d4"  # older versions' name: no writer recorded, keep
    other_name = tmp_path / f".other.tmp-{dead_pid()}@{host()}-0badc0de"  # not this final's
    for d in (live, other_host, before_pids, other_name):
        d.mkdir()
    atomic_directory_write(final, write_file("a.txt", "new"))
    assert (final / "a.txt").read_text() == "new"
    assert hidden(tmp_path) == sorted(d.name for d in (live, other_host, before_pids, other_name))


def test_a_writer_killed_between_the_two_renames_gets_the_previous_version_back(tmp_path):
    final = tmp_path / "out"
    parked = tmp_path / f".out.old-{dead_pid()}@{host()}"  # the previous version, moved aside
    parked.mkdir()
    (parked / "a.txt").write_text("previous")
    assert remove_stale_temp_dirs(tmp_path) == [parked]
    assert (final / "a.txt").read_text() == "previous" and hidden(tmp_path) == []


def modes(root: Path) -> set[tuple[str, int]]:
    return {("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode)) for p in [root, *root.rglob("*")]}


@pytest.mark.parametrize("mask, dirs, files", [(0o022, 0o755, 0o644), (0o007, 0o770, 0o660)])
def test_modes_follow_the_umask(tmp_path, umask, mask, dirs, files):
    umask(mask)

    def write(d: Path) -> None:
        (d / "sub").mkdir()
        (d / "sub" / "x.bin").write_bytes(b"x")
        atomic_directory_write(d / "nested", write_file("y.txt", "y"))

    out = atomic_directory_write(tmp_path / "out", write, job="prepare")
    assert modes(out) == {("dir", dirs), ("file", files)}


# -- prepare uses all of it ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tokenizer(tmp_path_factory.mktemp("tok"))


def run_prepare(tok, inputs, output, **kw) -> dict:
    cfg = PrepareConfig(inputs=[str(p) for p in inputs], output=str(output), progress=False, workers=1, **kw)
    return prepare(cfg, tokenizer=tok)


def jsonl(path: Path, n: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in synthetic_conversations(n)))
    return path


def test_prepare_overwrite_never_wipes_the_project_holding_its_input(tok, tmp_path):
    proj = tmp_path / "proj"
    c = jsonl(proj / "raw" / "c.jsonl", 4)
    (proj / "notes.md").write_text("weeks of work")
    with pytest.raises(OutputError, match="holds an input"):
        run_prepare(tok, [c], proj, overwrite=True)
    assert (proj / "notes.md").read_text() == "weeks of work" and c.is_file() and hidden(tmp_path) == []


def test_prepare_overwrite_replaces_only_its_own_output(tok, tmp_path):
    c = jsonl(tmp_path / "c.jsonl", 4)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(OutputError, match="not made by dflash-train"):
        run_prepare(tok, [c], foreign, overwrite=True)
    assert [p.name for p in foreign.iterdir()] == ["keep.txt"]
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    with pytest.raises(OutputError, match="is a file"):
        run_prepare(tok, [c], a_file, overwrite=True)
    assert a_file.read_text() == "mine"

    out = tmp_path / "ds"
    run_prepare(tok, [c], out)
    assert made_by(out) == "prepare"
    run_prepare(tok, [jsonl(tmp_path / "d.jsonl", 6)], out, overwrite=True)
    assert len(TokenDataset(out)) == 6


def test_prepare_removes_the_temp_dir_of_a_killed_prepare(tok, tmp_path):
    stale = tmp_path / f".ds.tmp-{dead_pid()}@{host()}-0badc0de"
    stale.mkdir()
    (stale / "shard-00000.arrow").write_bytes(b"partial")
    run_prepare(tok, [jsonl(tmp_path / "c.jsonl", 4)], tmp_path / "ds")
    assert hidden(tmp_path) == [] and len(TokenDataset(tmp_path / "ds")) == 4


def test_prepared_dataset_is_readable_by_others_under_umask_022(tok, tmp_path, umask):
    umask(0o022)
    out = tmp_path / "ds"
    run_prepare(tok, [jsonl(tmp_path / "c.jsonl", 4)], out)
    assert modes(out) == {("dir", 0o755), ("file", 0o644)}
