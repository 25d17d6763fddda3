"""The resumable JSONL writer: torn tails, broken files, locking."""

from __future__ import annotations

import json

import pytest

from dflash_train.generate.writer import JsonlAppender, OutputBusyError, read_rows, recover
from dflash_train.utils.errors import DataError


def test_recover_drops_only_a_torn_last_line(tmp_path):
    path = tmp_path / "out.jsonl"
    good = b'{"id": "a"}\n{"id": "b"}\n'
    path.write_bytes(good + b'{"id": "c", "mess')
    assert recover(path) == len(b'{"id": "c", "mess')
    assert path.read_bytes() == good
    assert recover(path) == 0 and path.read_bytes() == good
    path.write_bytes(b'{"id": "only-torn"}')  # valid JSON but no newline: the write was cut short
    recover(path)
    assert path.read_bytes() == b""
    assert recover(tmp_path / "missing.jsonl") == 0


def test_a_broken_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n')
    with pytest.raises(DataError, match="out.jsonl:2"):
        list(read_rows(path))
    path.write_text('{"no_id": 1}\n')
    with pytest.raises(DataError, match="no string 'id'"):
        list(read_rows(path))


def test_appender_writes_whole_lines_and_locks(tmp_path):
    path = tmp_path / "sub" / "out.jsonl"
    with JsonlAppender(path, flush_rows=2, flush_seconds=3600) as out:
        out.add({"id": "a", "text": "é"})
        assert path.read_bytes() == b""  # buffered until flush_rows
        out.add({"id": "b"})
        assert [r["id"] for r in read_rows(path)] == ["a", "b"]
        with pytest.raises(OutputBusyError):
            JsonlAppender(path)
        out.add({"id": "c"})
    assert [json.loads(line)["id"] for line in path.read_text(encoding="utf-8").splitlines()] == ["a", "b", "c"]
    with JsonlAppender(path) as out:  # the lock is released on close; appends go to the end
        out.add({"id": "d"})
    assert [r["id"] for r in read_rows(path)] == ["a", "b", "c", "d"]
