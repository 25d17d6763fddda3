"""Reading raw training rows: JSONL, JSON and Parquet files of conversations.

Every row becomes a `Record`: a list of chat messages plus where it came from. Three row
shapes are accepted:

    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", ...}]}
    {"prompt": "...", "response": "..."}          (also "completion"/"answer")
    {"text": "..."}                               (plain text, no chat template)

Other keys (ids, metadata) are kept in `Record.extra`. A malformed row raises
`DataError` naming the file, the line (1-based, or the row index for Parquet/JSON
arrays) and the field, so a user can fix it without guessing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from dflash_train.utils.errors import DataError, InputError
from dflash_train.utils.fs import MARKER, made_by, not_usable
from dflash_train.utils.jsonl import iter_json_rows

log = logging.getLogger(__name__)

VALID_ROLES = ("system", "user", "assistant", "tool")
RESPONSE_KEYS = ("response", "completion", "answer")
SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class Record:
    """One training example. `messages` is None for plain-text rows (then `text` is set)."""

    file: str
    line: int
    messages: list[dict[str, str]] | None = None
    text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


def check_messages(value: Any, file: str, line: int, *, need_assistant: bool = True) -> list[dict[str, str]]:
    """A validated list of {role, content} messages; DataError names the message at fault."""
    if not isinstance(value, list) or not value:
        raise DataError(file, line, "messages", "must be a non-empty list of {role, content}")
    out = []
    for i, msg in enumerate(value):
        name = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise DataError(file, line, name, f"must be an object, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if role not in VALID_ROLES:
            raise DataError(file, line, f"{name}.role", f"must be one of {list(VALID_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise DataError(file, line, f"{name}.content", f"must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise DataError(file, line, "messages", "has no assistant turn (nothing to learn from)")
    return out


def parse_row(obj: Any, file: str | Path, line: int) -> Record:
    """Validate one decoded row and turn it into a Record."""
    file = str(file)
    if not isinstance(obj, dict):
        raise DataError(file, line, None, f"row must be a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        extra = {k: v for k, v in obj.items() if k != "messages"}
        return Record(file, line, messages=check_messages(obj["messages"], file, line), extra=extra)
    if "prompt" in obj:
        resp_key = next((k for k in RESPONSE_KEYS if k in obj), None)
        if resp_key is None:
            raise DataError(file, line, "response", f"missing: a prompt row needs one of {list(RESPONSE_KEYS)}")
        prompt, response = obj["prompt"], obj[resp_key]
        if not isinstance(prompt, str):
            raise DataError(file, line, "prompt", f"must be a string, got {type(prompt).__name__}")
        if not isinstance(response, str):
            raise DataError(file, line, resp_key, f"must be a string, got {type(response).__name__}")
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
        if isinstance(obj.get("system"), str):
            messages.insert(0, {"role": "system", "content": obj["system"]})
        extra = {k: v for k, v in obj.items() if k not in ("prompt", resp_key, "system")}
        return Record(file, line, messages=messages, extra=extra)
    if "text" in obj:
        if not isinstance(obj["text"], str) or not obj["text"]:
            raise DataError(file, line, "text", "must be a non-empty string")
        return Record(file, line, text=obj["text"], extra={k: v for k, v in obj.items() if k != "text"})
    raise DataError(file, line, None, "row has none of the fields 'messages', 'prompt', 'text'")


def _iter_raw(path: Path) -> Iterator[tuple[int, Any]]:
    """(line or row number, decoded object or DataError) for every row of one file.

    An undecodable JSONL line is yielded as a DataError (not raised) so that callers
    skipping bad rows can carry on with the next line; a file that cannot be read at all
    raises DataError naming it. `path` is one of `expand_inputs`' files: a supported type."""
    if path.suffix.lower() == ".parquet":
        yield from _iter_parquet(path)
    else:
        yield from iter_json_rows(path)


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    row = 0
    try:
        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            for obj in batch.to_pylist():
                row += 1
                yield row, obj
    except (pa.ArrowException, OSError) as exc:
        raise DataError(path, row + 1 if row else None, None, f"cannot read this Parquet file: {exc}") from None


def expand_inputs(paths: list[str | Path]) -> list[Path]:
    """Files and directories (searched for supported files) -> sorted list of files; a named
    file of an unsupported type is a DataError naming it."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(_files_in(p))
        elif p.is_file():
            if p.suffix.lower() not in SUPPORTED_SUFFIXES:  # said before a tokenizer or model loads
                raise DataError(p, None, None, f"unsupported file type {p.suffix.lower()!r}; "
                                f"use {', '.join(SUPPORTED_SUFFIXES)}")
            out.append(p)
        else:
            raise InputError(not_usable("input", p))
    if not out:
        raise InputError(f"no {'/'.join(SUPPORTED_SUFFIXES)} files in {', '.join(map(str, paths))}")
    return out


def _files_in(directory: Path) -> list[Path]:
    """The supported files below `directory`, except those of a dataset `prepare` wrote there (an
    output inside its input folder): its manifest.json and bad-row files are not conversations."""
    prepared = [m.parent for m in directory.rglob(MARKER) if m.parent != directory and made_by(m.parent) == "prepare"]
    for d in prepared:
        log.warning("%s: skipped, a dataset written by dflash-train prepare (not conversations)", d)
    return sorted(q for q in directory.rglob("*") if q.suffix.lower() in SUPPORTED_SUFFIXES
                  and not any(d in q.parents for d in prepared))


def iter_records(paths: list[str | Path], *, skip_bad: bool = False, bad: list[DataError] | None = None) -> Iterator[Record]:
    """Records of all files in order. With skip_bad, malformed rows go to `bad` instead of raising."""
    for path in expand_inputs(paths):
        for line, obj in _iter_raw(path):
            try:
                if isinstance(obj, DataError):
                    raise obj
                yield parse_row(obj, path, line)
            except DataError as err:
                if not skip_bad:
                    raise
                if bad is not None:
                    bad.append(err)
