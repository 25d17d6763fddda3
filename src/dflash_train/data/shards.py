"""The prepared dataset's Arrow shards, as the prepare job writes them (data/dataset.py reads them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

BATCH_ROWS = 1024  # rows per Arrow record batch: small enough to buffer, large enough to be cheap
FORMAT_VERSION = 1  # of a prepared dataset (its manifest's format_version): bump when the layout changes
MANIFEST = "manifest.json"


class ShardWriter:
    """Rows appended in order into shard-NNNNN.arrow files of `shard_size` rows each (the last one
    shorter), written in record batches of BATCH_ROWS; `close` returns each shard's rows and tokens."""

    def __init__(self, directory: Path, shard_size: int):
        self.schema = pa.schema(
            [
                ("input_ids", pa.list_(pa.int32())),
                ("loss_mask", pa.list_(pa.uint8())),
                ("length", pa.int32()),
                ("source", pa.string()),
            ]
        )
        self.directory, self.shard_size = directory, shard_size
        self.shards: list[dict[str, Any]] = []
        self._writer = None
        self._rows_in_shard = 0
        self._buf: list[tuple[np.ndarray, np.ndarray, str]] = []

    def add(self, ids: np.ndarray, mask: np.ndarray, source: str) -> None:
        self._buf.append((ids, mask, source))
        if len(self._buf) == BATCH_ROWS or self._rows_in_shard + len(self._buf) == self.shard_size:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        if self._writer is None:
            name = f"shard-{len(self.shards):05d}.arrow"
            self._writer = pa.ipc.new_file(str(self.directory / name), self.schema)
            self.shards.append({"file": name, "rows": 0, "tokens": 0})
        lengths = np.fromiter((len(b[0]) for b in self._buf), dtype=np.int32, count=len(self._buf))
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
        batch = pa.record_batch(
            [
                pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([b[0] for b in self._buf]))),
                pa.ListArray.from_arrays(offsets, pa.array(np.concatenate([b[1] for b in self._buf]))),
                pa.array(lengths),
                pa.array([b[2] for b in self._buf], pa.string()),
            ],
            schema=self.schema,
        )
        self._writer.write_batch(batch)
        self.shards[-1]["rows"] += len(self._buf)
        self.shards[-1]["tokens"] += int(lengths.sum())
        self._rows_in_shard += len(self._buf)
        self._buf = []
        if self._rows_in_shard >= self.shard_size:
            self._close_shard()

    def _close_shard(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer, self._rows_in_shard = None, 0

    def close(self) -> list[dict[str, Any]]:
        self._flush()
        self._close_shard()
        return self.shards
