"""`prepare`: raw rows -> tokenized Arrow shards + manifest.json.

Output directory layout (format version 1):

    manifest.json          tokenizer identity, counts, token statistics, shard list
    shard-00000.arrow      Arrow IPC *file* format (random access, memory-mapped on read)
    ...
    bad_rows.jsonl         only with --skip-bad-rows and bad rows: every skipped row and why

Shard schema, one row per training sample, written in record batches of 1,024 rows:

    input_ids  list<int32>   token ids of the rendered conversation
    loss_mask  list<uint8>   1 on assistant tokens (see data/render.py), 0 elsewhere;
                             uint8 rather than bool so reads are zero-copy numpy views
    length     int32         len(input_ids), read alone by the batch planner
    source     string        "file:line" of the raw row, for debugging

The run writes into a hidden temporary directory next to the output and renames it at
the end, so a failed or interrupted run never leaves a half dataset that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import signal
import sys
import time
from array import array
from collections import deque
from concurrent.futures import Future, ProcessPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal

import numpy as np
import pyarrow.parquet as pq
from tqdm import tqdm
from transformers import AutoTokenizer

from dflash_train import __version__
from dflash_train.data.render import ChatRenderer
from dflash_train.data.shards import FORMAT_VERSION, MANIFEST, ShardWriter
from dflash_train.data.sources import Record, expand_inputs, iter_records
from dflash_train.target.loading import load_tokenizer, tokenizer_identity
from dflash_train.utils.config import cli
from dflash_train.utils.device import idle_cores
from dflash_train.utils.errors import DataError
from dflash_train.utils.fs import atomic_directory_write, check_output_dir
from dflash_train.utils.signals import StopSignals

JOB = "prepare"  # named in the marker file of the directories it writes
CHUNK_ROWS = 64  # rows per task sent to a worker process
MAX_LISTED_BAD_ROWS = 1000  # bad rows listed in the manifest itself; bad_rows.jsonl has them all


@dataclass
class PrepareConfig:
    inputs: list[str] = field(default_factory=list, metadata=cli(positional=True))
    """JSONL / JSON / Parquet files of conversations, or directories of them"""
    output: str = field(default="", metadata=cli(aliases=("-o",)))
    """output directory (must not exist unless --overwrite)"""
    target: str = "builtin"
    """whose tokenizer and chat template: a model directory, a .gguf file, a directory with
    tokenizer files only, or 'builtin' (SmolLM2-135M-Instruct)"""
    max_length: int = 8192
    """maximum tokens per row"""
    overflow: Literal["truncate", "drop"] = "truncate"
    """what to do with longer rows; either way they are counted"""
    skip_bad_rows: bool = False
    """count and list malformed rows instead of stopping at the first one"""
    workers: int = 0
    """tokenizer processes (0 = idle cores - 1; 1 = in-process, with the tokenizer's own threads)"""
    shard_size: int = 100_000
    """rows per shard file"""
    overwrite: bool = False
    """replace an existing output directory"""
    chat_template: str | None = None
    """a Jinja chat template file to use instead of the tokenizer's"""
    text_eos: bool = False
    """append EOS to plain-text rows"""
    token_budget: int = 49152
    """tokens per batch of the batch table printed at the end: give the data.plan.token_budget the training
    config sets (the default is train's own default)"""
    progress: bool = True
    """show a progress bar"""

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("no inputs given")
        if not self.output:
            raise ValueError("no output directory given (--output DIR)")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {self.max_length}")
        if self.workers < 0 or self.shard_size < 1 or self.token_budget < 1:
            raise ValueError("workers must be >= 0, shard_size and token_budget >= 1")


# -- tokenizer -------------------------------------------------------------------------------


def load_target_tokenizer(target: str):
    """The tokenizer of `target`: anything `load_tokenizer` takes, or a directory holding
    only tokenizer files (tokenizer.json / tokenizer_config.json)."""
    path = Path(target).expanduser()
    if path.is_dir() and not (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return load_tokenizer(target)


# -- per-row work (runs in worker processes) ---------------------------------------------------

# Per input row, in input order, a list of results: one per output row (a conversation
# becomes one row per assistant turn under a template that re-renders history), or one
# ("bad", DataError):
#   ("ok", input_ids, loss_mask, source, truncated) | ("too_long", source, length)
#   ("no_loss", source) | ("bad", DataError)
Result = tuple

_worker_state: dict[str, Any] = {}


def _init_worker(renderer: ChatRenderer, max_length: int, overflow: str, threads: bool = False) -> None:
    if not threads:  # worker processes: the parallelism is the processes
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        # Ctrl-C, `timeout` and schedulers signal the whole process group. A worker killed while
        # it writes a result leaves half a message in the result pipe, and the pool's reader
        # then waits forever: so only the parent acts on these signals, and stops its workers.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _worker_state.update(renderer=renderer, max_length=max_length, overflow=overflow)


def default_workers() -> int:
    """One process per idle core but one: the main process parses rows and writes shards.
    With a single worker, tokenisation runs in-process and the Rust tokenizer uses its own
    threads (on a 2-core machine that beats two processes fighting the main one for the
    cores). Cores other processes keep busy are left to them, as `eval` does."""
    return max(1, idle_cores() - 1)


def _apply_limits(encoded: tuple[np.ndarray, np.ndarray], where: str, max_length: int,
                  overflow: str) -> Result:
    ids, mask = encoded
    truncated = False
    if len(ids) > max_length:
        if overflow == "drop":
            return ("too_long", where, len(ids))
        ids, mask, truncated = ids[:max_length], mask[:max_length], True
    if not mask[1:].any():  # a loss token at position 0 can never be a label (nothing precedes it)
        return ("no_loss", where)
    return ("ok", ids, mask.astype(np.uint8), where, truncated)


def _encode_chunk(chunk: list[Record]) -> list[list[Result]]:
    s = _worker_state
    out = []
    for rows, rec in zip(s["renderer"].encode_records(chunk), chunk):  # one tokenizer call for the chunk
        if isinstance(rows, DataError):
            out.append([("bad", rows)])
            continue
        names = [rec.where] if len(rows) == 1 else [f"{rec.where}#{k}" for k in range(len(rows))]
        out.append([_apply_limits(row, name, s["max_length"], s["overflow"]) for row, name in zip(rows, names)])
    return out


def _chunks(records: Iterable[Record], size: int) -> Iterator[list[Record]]:
    chunk: list[Record] = []
    for rec in records:
        # `extra` (ids, metadata) is not needed to tokenize: do not ship it to workers.
        chunk.append(Record(rec.file, rec.line, messages=rec.messages, text=rec.text))
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _encode_all(chunks: Iterator[list[Record]], workers: int, init_args: tuple) -> Iterator[list[Result]]:
    """Chunk results in input order. A bounded number of chunks is in flight, so memory
    does not grow with the input (Pool.imap would read the whole input ahead).

    With worker processes, SIGINT/SIGTERM only set a flag, read while waiting for a result:
    the job then stops at a chunk boundary, the workers finish the chunk they hold and exit
    (no worker is killed mid-write), and the caller removes what was written."""
    if workers <= 1:
        # In-process: the Rust tokenizer spreads each chunk over its own threads.
        _init_worker(*init_args, threads=True)
        for chunk in chunks:
            yield _encode_chunk(chunk)
        return
    # fork shares the already-loaded tokenizer with the workers for free; spawn elsewhere.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    with StopSignals() as stop:
        pool = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=init_args)
        try:
            pending: deque[Future] = deque()
            for chunk in chunks:
                pending.append(pool.submit(_encode_chunk, chunk))
                if len(pending) >= 4 * workers:
                    yield _result(pending.popleft(), stop)
            while pending:
                yield _result(pending.popleft(), stop)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)


def _result(future: Future, stop: StopSignals) -> list[list[Result]]:
    while True:
        if stop.received:
            raise KeyboardInterrupt(stop.received)
        try:
            return future.result(timeout=0.2)
        except TimeoutError:
            continue


def _count_rows(paths: list[Path]) -> int | None:
    """Cheap row count for the progress bar (JSONL newlines, Parquet metadata); None if unknown."""
    total = 0
    for p in paths:
        suffix = p.suffix.lower()
        if suffix == ".jsonl":
            with p.open("rb") as fh:
                total += sum(block.count(b"\n") for block in iter(lambda: fh.read(1 << 22), b""))
        elif suffix == ".parquet":
            total += pq.ParquetFile(p).metadata.num_rows
        else:
            return None
    return total


def _length_stats(lengths: np.ndarray) -> dict[str, float]:
    if len(lengths) == 0:
        return {}
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    return {"min": int(lengths.min()), "mean": round(float(lengths.mean()), 2), "p50": float(p50),
            "p90": float(p90), "p99": float(p99), "max": int(lengths.max())}


def _prepare_output(cfg: PrepareConfig, files: list[Path]) -> Path:
    """The output directory, resolved, once `check_output_dir` agrees to write it: never a
    file, never one holding (or inside) the inputs, replaced only with --overwrite when an
    earlier prepare made it."""
    return check_output_dir(cfg.output, overwrite=cfg.overwrite, inputs=[*cfg.inputs, *files], job=JOB)


def read_chat_template(path: str | Path) -> str:
    """The text of a --chat-template file, compiled once here: a Jinja error names the file and its
    line rather than surfacing as a rejection of the first data row."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(path, None, None, f"cannot read this chat template file "
                                          f"({getattr(exc, 'strerror', None) or exc})") from None
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template  # the compiler transformers renders with

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateError as exc:
        raise DataError(path, getattr(exc, "lineno", None), None,
                        f"not a valid Jinja chat template: {getattr(exc, 'message', None) or exc}") from None
    return text


def prepare(cfg: PrepareConfig, tokenizer: Any = None) -> dict[str, Any]:
    """Run the whole prepare job; returns the manifest. `tokenizer` skips loading `cfg.target`.

    Raises DataError on the first malformed row (unless cfg.skip_bad_rows) and
    OutputError when the output must not be written (`_prepare_output`)."""
    files = expand_inputs(cfg.inputs)
    output = _prepare_output(cfg, files)  # fail before the expensive part
    template = read_chat_template(cfg.chat_template) if cfg.chat_template else None
    tok = tokenizer if tokenizer is not None else load_target_tokenizer(cfg.target)
    identity = tokenizer_identity(tok)  # of the tokenizer as the target ships it: the trainer compares this
    renderer = ChatRenderer(tok, chat_template=template, text_eos=cfg.text_eos)

    result: dict[str, Any] = {}

    def write(tmp: Path) -> None:
        manifest = _run(cfg, files, renderer, tmp)
        if not manifest["counts"]["rows_kept"]:  # nothing to train on: write no dataset at all
            c = manifest["counts"]
            raise DataError(", ".join(map(str, files)), None, None,
                            f"no row was kept (read {c['rows_read']}: {c['dropped_too_long']} too long, "
                            f"{c['dropped_no_loss']} with no assistant tokens, {c['bad_rows']} bad); "
                            f"nothing was written")
        manifest.update(
            tokenizer=identity,
            chat_template={
                "source": str(Path(cfg.chat_template).resolve()) if cfg.chat_template else "tokenizer",
                "sha256": hashlib.sha256((renderer.chat_template or "").encode()).hexdigest()[:16],
            },
        )
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
        result.update(manifest)

    # written into a temporary directory and renamed: a failed run leaves no half dataset
    atomic_directory_write(output, write, job=JOB, before_swap=lambda: _prepare_output(cfg, files))
    manifest = result
    return manifest


@dataclass
class _Tally:
    """What the encoded rows came to: counts, the kept rows' lengths and loss tokens, and the rows the
    chat template rejected (skip mode; otherwise the first one is raised)."""
    skip_bad: bool
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ["rows_read", "rows_kept", "truncated", "dropped_too_long", "dropped_no_loss", "split_rows"], 0))
    lengths: array = field(default_factory=lambda: array("i"))
    loss_tokens: int = 0
    render_bad: list[DataError] = field(default_factory=list)

    def add(self, res: tuple, writer: ShardWriter) -> None:
        kind = res[0]
        if kind == "ok":
            _, ids, mask, source, truncated = res
            writer.add(ids, mask, source)
            self.lengths.append(len(ids))
            self.loss_tokens += int(mask.sum())
            self.counts["rows_kept"] += 1
            self.counts["truncated"] += int(truncated)
        elif kind == "too_long":
            self.counts["dropped_too_long"] += 1
        elif kind == "no_loss":
            self.counts["dropped_no_loss"] += 1
        elif not self.skip_bad:
            raise res[1]
        else:
            self.render_bad.append(res[1])


def _run(cfg: PrepareConfig, files: list[Path], renderer: ChatRenderer, out: Path) -> dict[str, Any]:
    workers = cfg.workers or default_workers()
    parse_bad: list[DataError] = []  # rows that fail to parse land here (skip mode)
    records = iter_records(files, skip_bad=cfg.skip_bad_rows, bad=parse_bad)
    writer = ShardWriter(out, cfg.shard_size)
    tally = _Tally(cfg.skip_bad_rows)
    started = time.time()
    total = _count_rows(files) if cfg.progress else None
    bar = tqdm(total=total, unit="rows", disable=not cfg.progress, file=sys.stderr, dynamic_ncols=True,
               desc="prepare")
    seen_parse_bad = 0
    encoded = _encode_all(_chunks(records, CHUNK_ROWS), workers, (renderer, cfg.max_length, cfg.overflow))
    with closing(encoded):  # a bad row raised here stops the workers now, not when the generator is collected
        for results in encoded:
            for res in (r for row_results in results for r in row_results):
                tally.add(res, writer)
            tally.counts["rows_read"] += len(results)
            tally.counts["split_rows"] += sum(len(r) for r in results if len(r) > 1)
            bar.update(len(results) + len(parse_bad) - seen_parse_bad)
            seen_parse_bad = len(parse_bad)
    tally.counts["rows_read"] += len(parse_bad)
    bar.close()
    shards = writer.close()
    bad_list = _write_bad_rows(out, files, parse_bad + tally.render_bad)
    return _manifest(cfg, files, tally, bad_list, shards, time.time() - started)


def _write_bad_rows(out: Path, files: list[Path], bad: list[DataError]) -> list[dict]:
    """The skipped rows in file and line order, written to bad_rows.jsonl when there are any."""
    order = {str(f): i for i, f in enumerate(files)}
    bad_list = [e.to_dict() for e in sorted(bad, key=lambda e: (order.get(e.file, len(order)), e.line or 0))]
    if bad_list:
        with (out / "bad_rows.jsonl").open("w") as fh:
            fh.writelines(json.dumps(b, ensure_ascii=False) + "\n" for b in bad_list)
    return bad_list


def _manifest(cfg: PrepareConfig, files: list[Path], tally: _Tally, bad_list: list[dict], shards: list,
              seconds: float) -> dict[str, Any]:
    lens = np.frombuffer(tally.lengths, dtype=np.int32) if len(tally.lengths) else np.zeros(0, np.int32)
    return {
        "format_version": FORMAT_VERSION,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "dflash_train_version": __version__,
        "inputs": [str(p.resolve()) for p in files],
        "options": {"max_length": cfg.max_length, "overflow": cfg.overflow, "skip_bad_rows": cfg.skip_bad_rows,
                    "text_eos": cfg.text_eos, "shard_size": cfg.shard_size},
        "counts": {**tally.counts, "bad_rows": len(bad_list)},
        "bad_rows": bad_list[:MAX_LISTED_BAD_ROWS],
        "bad_rows_file": "bad_rows.jsonl" if bad_list else None,
        "tokens": {"total": int(lens.sum()), "loss": tally.loss_tokens, "length": _length_stats(lens)},
        "shards": shards,
        "schema": {"input_ids": "list<int32>", "loss_mask": "list<uint8>", "length": "int32", "source": "string"},
        "seconds": round(seconds, 2),
    }
