"""`TokenDataset`: the shards written by `prepare`, opened lazily.

Shards are Arrow IPC files opened with `pyarrow.memory_map`: nothing is read at open
except the manifest, the record-batch headers and the `length` column. A sample is
fetched in O(1) (a binary search over record-batch offsets, then two zero-copy numpy
views into the mapped file). Memory held by the object is the `lengths` array (4 bytes
per sample) plus a few hundred bytes per 1,024-row record batch; the pages of the file
that are read are page cache shared between processes, reclaimable by the OS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

from dflash_train.data.shards import FORMAT_VERSION, MANIFEST
from dflash_train.utils.errors import DataError, InputError
from dflash_train.utils.fs import missing_reason


class Sample(NamedTuple):
    input_ids: np.ndarray  # int32 [L], read-only view into the mapped shard
    loss_mask: np.ndarray  # bool [L], read-only view


def read_manifest(path: Path) -> dict[str, Any]:
    """A dataset's manifest.json, checked as far as reading the shards needs: a file that is not
    one (cut short, edited, another tool's) is named, with what is wrong in it."""
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError(path, None, None, "not UTF-8 text: not a manifest prepare wrote; re-run prepare") from None
    except json.JSONDecodeError as exc:
        raise DataError(path, exc.lineno, None, f"invalid JSON ({exc.msg}, column {exc.colno}): the manifest is "
                                                f"damaged; re-run prepare") from None
    if not isinstance(manifest, dict):
        raise DataError(path, None, None, "not a JSON object: not a manifest prepare wrote; re-run prepare")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise DataError(path.parent, None, None, f"dataset format {version}, this version reads {FORMAT_VERSION}; "
                                                 f"re-run prepare")
    shards = manifest.get("shards")
    if not isinstance(shards, list):
        raise DataError(path, None, "shards", "missing or not a list; re-run prepare")
    for k, shard in enumerate(shards):
        if not (isinstance(shard, dict) and isinstance(shard.get("file"), str) and isinstance(shard.get("rows"), int)
                and Path(shard["file"]).name == shard["file"]):
            raise DataError(path, None, f"shards[{k}]", "must be {\"file\": a file name in the dataset, "
                                                        "\"rows\": an integer}; re-run prepare")
    if not isinstance(manifest.get("tokenizer", {}), dict):
        raise DataError(path, None, "tokenizer", "must be an object; re-run prepare")
    return manifest


class TokenDataset:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not self.path.is_dir():
            raise InputError(f"{self.path}: {missing_reason(self.path, want='folder')} (a dataset folder written by "
                             f"dflash-train prepare)")
        if not manifest_path.is_file():
            raise InputError(f"{self.path}: no {MANIFEST} (not a prepared dataset, or prepare did not finish)")
        self.manifest: dict[str, Any] = read_manifest(manifest_path)
        self._batches: list = []  # pyarrow RecordBatch objects backed by the mapped files
        counts: list[int] = []
        lengths: list[np.ndarray] = []
        for shard in self.manifest["shards"]:
            file = self.path / shard["file"]
            try:
                reader = pa.ipc.open_file(pa.memory_map(str(file), "r"))
                rows = 0
                for k in range(reader.num_record_batches):
                    batch = reader.get_batch(k)
                    self._batches.append(batch)
                    counts.append(batch.num_rows)
                    lengths.append(batch.column("length").to_numpy())
                    rows += batch.num_rows
            except (OSError, pa.ArrowException) as exc:  # a truncated or damaged shard (a copy cut short)
                raise DataError(file, None, None, f"cannot read this shard ({exc}); copy it again or re-run "
                                                  f"prepare") from None
            if rows != shard["rows"]:
                raise DataError(self.path / shard["file"], None, None, f"{rows} rows, the manifest says {shard['rows']}")
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self.lengths: np.ndarray = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
        self._views: list[tuple[np.ndarray, np.ndarray, np.ndarray] | None] = [None] * len(self._batches)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[int, int]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n}")
        b = int(np.searchsorted(self._starts, i, side="right")) - 1
        return b, i - int(self._starts[b])

    def _batch_views(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        views = self._views[b]
        if views is None:
            batch = self._batches[b]
            ids, mask = batch.column("input_ids"), batch.column("loss_mask")
            # `.offsets` honours any slice offset, `.values` is the whole child array: consistent.
            views = (ids.offsets.to_numpy(), ids.values.to_numpy(), mask.values.to_numpy().view(np.bool_))
            self._views[b] = views
        return views

    def __getitem__(self, i: int) -> Sample:
        b, r = self._locate(int(i))
        offsets, ids, mask = self._batch_views(b)
        lo, hi = offsets[r], offsets[r + 1]
        return Sample(ids[lo:hi], mask[lo:hi])

    def source(self, i: int) -> str:
        """"file:line" of the raw row sample `i` came from."""
        b, r = self._locate(int(i))
        return self._batches[b].column("source")[r].as_py()

    def check_tokenizer(self, identity: dict[str, Any]) -> None:
        """Raise if `identity` (`tokenizer_identity(target_tokenizer)`) differs from the one
        the data was prepared with. The name (a local path) is not compared."""
        mine = self.manifest.get("tokenizer", {})
        diff = [k for k in ("vocab_size", "vocab_sha256", "chat_template_sha256") if mine.get(k) != identity.get(k)]
        if diff:
            pairs = ", ".join(f"{k}: data {mine.get(k)!r} vs target {identity.get(k)!r}" for k in diff)
            raise DataError(self.path, None, None, f"prepared with a different tokenizer ({pairs}); re-run prepare")

    # Workers of a DataLoader get a pickled copy: reopen the files instead of copying views.
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])
