"""The one reader of JSON rows: a `.jsonl` file (one object per line) or a `.json` list.

Text is UTF-8; a byte-order mark at the start of the file is ignored (editors on Windows
write one). A line that is not UTF-8 or not JSON is yielded as a `DataError` naming
file:line (and the column), not raised, so callers that skip bad rows go on with the next
line; callers that do not skip raise it. A `.json` file is one document: if it cannot be
decoded the error names the file (and the line/column of the JSON error).

JSON may escape a lone UTF-16 surrogate (`"\ud83d"`): valid JSON, but no Unicode text, so
every tokenizer, hash and UTF-8 writer downstream would fail on it. A row holding one is a
`DataError` naming the field, like any other malformed row.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator

from dflash_train.utils.errors import DataError, InputError

BOM = b"\xef\xbb\xbf"
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _decode(raw: bytes, path: Path, line: int | None) -> str | DataError:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return DataError(path, line, None, f"not UTF-8 text (byte {exc.start + 1} is {raw[exc.start:exc.start + 1]!r}); "
                                           f"convert the file to UTF-8")


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded object or DataError) for every non-blank line of a JSONL file."""
    path = Path(path)
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
    with fh:
        for lineno, raw in enumerate(fh, start=1):
            if lineno == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            text = _decode(raw, path, lineno)
            if isinstance(text, DataError):
                yield lineno, text
                continue
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                yield lineno, DataError(path, lineno, None, f"invalid JSON: {exc.msg} (column {exc.colno})")
                continue
            yield lineno, _surrogate_error(obj, path, lineno) if _may_hold_surrogates(text) else obj


def _may_hold_surrogates(text: str) -> bool:
    """A cheap test first: a lone surrogate can only come from a `\\uD800`-`\\uDFFF` escape."""
    return _SURROGATE_ESCAPE.search(text) is not None


def _surrogate_error(obj: Any, path: Path, line: int) -> Any:
    """`obj`, or a DataError naming the first string in it (key or value) with a lone surrogate."""
    found = _find_surrogate(obj, "")
    if found is None:
        return obj
    where, text = found
    at = next(i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff")
    return DataError(path, line, where or None,
                     f"holds a lone UTF-16 surrogate (\\u{ord(text[at]):04x} at character {at + 1}), which is "
                     f"not Unicode text; write the character itself or its full surrogate pair")


def _find_surrogate(obj: Any, where: str) -> tuple[str, str] | None:
    if isinstance(obj, str):
        return (where, obj) if any("\ud800" <= ch <= "\udfff" for ch in obj) else None
    if isinstance(obj, list):
        for i, value in enumerate(obj):
            if (found := _find_surrogate(value, f"{where}[{i}]")) is not None:
                return found
    elif isinstance(obj, dict):
        for key, value in obj.items():
            name = f"{where}.{key}" if where else str(key)
            if (found := _find_surrogate(key, name) or _find_surrogate(value, name)) is not None:
                return found
    return None


def load_json(path: str | Path) -> Any:
    """A whole `.json` document; a file that cannot be read or decoded raises DataError."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror}") from None
    text = _decode(raw.removeprefix(BOM), path, None)
    if isinstance(text, DataError):
        raise text
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(path, exc.lineno, None, f"invalid JSON: {exc.msg} (column {exc.colno})") from None


def iter_json_rows(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Rows of a `.jsonl` file, or of a `.json` file holding a list (or one object, or an
    object whose single value is the list): (1-based line/row number, object or DataError)."""
    path = Path(path)
    if path.suffix.lower() != ".json":
        yield from iter_jsonl(path)
        return
    data = load_json(path)
    if isinstance(data, dict):
        data = next((v for v in data.values() if isinstance(v, list)), None) if len(data) == 1 else [data]
    if not isinstance(data, list):
        raise DataError(path, None, None, "a .json file must hold a list of rows")
    for n, row in enumerate(data, start=1):
        yield n, _surrogate_error(row, path, n)


def read_json_rows(path: str | Path) -> list[tuple[int, Any]]:
    """All rows of a file, raising the first bad one."""
    rows = []
    for n, obj in iter_json_rows(path):
        if isinstance(obj, DataError):
            raise obj
        rows.append((n, obj))
    return rows
