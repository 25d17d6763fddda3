"""Where training metrics go, and when.

`MetricsLogger`: a progress bar, log lines, metrics.jsonl and TensorBoard. `StepLog` keeps the
training log's time: each step's statistics go into the current window, and every run.log_every
steps (and at the last step) the window becomes one record and one log line.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm.auto import tqdm

from dflash_train.data.batch import PackedBatch
from dflash_train.drafter.loss import StepStats, summarize
from dflash_train.pipeline.sources import reduce_stats
from dflash_train.train.timing import StageTimer
from dflash_train.utils.errors import TrainingError

STAGES = ("data", "queue_wait", "target", "forward", "backward", "optimizer")

log = logging.getLogger(__name__)


def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"


def read_records(path: Path) -> list[tuple[str, dict]]:
    """(line, record) of each line of a metrics.jsonl, checked before a run appends to it.

    A last line without its newline that is not JSON is what a full disk or a power loss
    leaves while a line is appended: it is dropped with a warning. Any other line that is not
    a JSON object means the file is not (only) ours: TrainingError naming the line."""
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.split("\n")
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            out.append((line, record))
        elif number == len(lines):  # no newline after it: a write cut short
            log.warning("%s:%d: dropping a last line cut short (%d bytes; a disk that filled or a crash while "
                        "it was written)", path, number, len(line))
        else:
            raise TrainingError(f"{path}:{number}: not a metrics record (a JSON object per line); move the file "
                                f"away, or choose another run.output_dir")
    return out


class MetricsLogger:
    def __init__(self, output_dir: Path, *, total_steps: int, start_step: int, tensorboard: bool, progress: bool,
                 enabled: bool = True):
        self.enabled = enabled  # data-parallel replicas other than the main one record nothing
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writer = None
        if tensorboard and enabled:
            self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not progress, file=sys.stderr)

    def truncate_after(self, step: int) -> None:
        """On resume, forget records of steps after the checkpoint (they will be redone); a last
        line cut short goes too. Rewritten whole and renamed, so a crash here loses nothing."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [line for line, record in read_records(self.path) if record.get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.path)

    def progress(self, step: int, postfix: dict[str, float]) -> None:
        self.bar.n = step
        self.bar.set_postfix({k: (_fmt_rate(v) if k == "tok/s" else f"{v:.3g}") for k, v in postfix.items()}, refresh=False)
        self.bar.refresh()

    def record(self, step: int, scalars: dict[str, float], kind: str = "train") -> None:
        if not self.enabled:
            return
        row = {"step": step, "kind": kind, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                             for k, v in scalars.items()}}
        with self.path.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for k, v in scalars.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(f"{kind}/{k}", v, step)

    def set_total(self, total_steps: int) -> None:
        self.bar.total = total_steps
        self.bar.refresh()

    def line(self, text: str) -> None:
        if self.enabled and text:
            log.info("%s", text)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


class Window:
    """Step statistics since the last log line."""

    def __init__(self) -> None:
        self.stats: list[StepStats] = []
        self.tokens = 0
        self.steps = 0
        self.start = time.perf_counter()

    def add(self, micro: list[StepStats], tokens: int) -> None:
        """One optimizer step's micro-batches."""
        self.stats.extend(micro)
        self.tokens += tokens
        self.steps += 1

    def tok_per_s(self, num_drafters: int) -> float:
        return self.tokens * num_drafters / max(time.perf_counter() - self.start, 1e-9)

    def metrics(self, timer: StageTimer, *, group, num_drafters: int, lr: float, grad_norm: float,
                device: torch.device) -> tuple[dict, dict]:
        """(metrics summed over the drafter replicas, stage seconds); one collective when D > 1."""
        seconds = time.perf_counter() - self.start
        stats = reduce_stats(self.stats, group) if num_drafters > 1 else self.stats
        m = summarize(stats)
        m.update(lr=lr, tok_per_s=self.tokens * num_drafters / max(seconds, 1e-9), grad_norm=grad_norm,
                 window_tokens=self.tokens * num_drafters, window_s=seconds)
        if device.type == "cuda":
            m["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        return m, timer.collect()


class StepLog:
    """The training log's own time (see the module's docstring), on a MetricsLogger."""

    def __init__(self, metrics: MetricsLogger, timer: StageTimer, *, every: int, block_size: int, group,
                 num_drafters: int, device: torch.device, clock: Callable[[], float]):
        self.metrics, self.timer, self.every, self.block_size = metrics, timer, every, block_size
        self.group, self.num_drafters, self.device = group, num_drafters, device
        self.clock = clock  # seconds since this process started training: the first step's line says them
        self.window = Window()
        self.windows = 0  # log windows written by this process
        self.last: dict = {}  # the last window's metrics

    def step_done(self, step: int, micro: list[StepStats], tokens: int) -> None:
        """An applied optimizer step: into the window, and onto the progress bar."""
        self.window.add(micro, tokens)
        if self.windows == 0 and self.window.steps == 1:  # the compiles are behind us: say so, and the memory held
            self.metrics.line(first_step_line(self.clock(), self.device))
        self.metrics.progress(step, {"tok/s": self.window.tok_per_s(self.num_drafters),
                                     **{k: self.last[k] for k in ("loss", "tau") if k in self.last}})

    def due(self, step: int, total: int) -> bool:
        return step % self.every == 0 or step == total

    def maybe_log(self, step: int, *, total: int, lr: float, grad_norm: torch.Tensor) -> bool:
        """At every `every`-th step and the `total`-th: the window's metrics (summed over the drafter
        replicas: one collective, and the one host read of the gradient norm) recorded and said."""
        if not self.due(step, total):
            return False
        m, split = self.window.metrics(self.timer, group=self.group, num_drafters=self.num_drafters, lr=lr,
                                       grad_norm=float(grad_norm), device=self.device)
        self.metrics.record(step, {**m, **{f"time_{k}_s": v for k, v in split.items()}})
        busy = sum(split.values()) or 1.0
        self.metrics.line(format_train_line(step, total, {**m, "split": {k: split.get(k, 0.0) / busy for k in STAGES}},
                                            self.block_size))
        self.last, self.window = m, Window()
        self.windows += 1
        return True


def first_step_line(elapsed_s: float, device: torch.device) -> str:
    """Said once, after this process's first optimizer step: the wait for the compiles and the first
    batches is over, and on a GPU the memory the run now holds (for whatever shares the device)."""
    text = f"first step done {elapsed_s:.1f}s after the start"
    if device.type == "cuda":
        text += (f"; peak memory {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB allocated, "
                 f"{torch.cuda.max_memory_reserved(device) / 2**30:.1f} GiB reserved")
    return text


def format_train_line(step: int, total: int, m: dict[str, float], block_size: int) -> str:
    accs = " ".join(f"{m.get(f'acc_{k}', float('nan')):.2f}" for k in range(1, block_size))
    split = m.get("split", {})
    split_txt = " ".join(f"{k} {v:.0%}" for k, v in split.items())
    mem = f" | mem {m['peak_mem_gib']:.1f} GiB" if "peak_mem_gib" in m else ""
    return (f"step {step}/{total} | loss {m['loss']:.4f} ce {m['ce']:.3f} | tau {m['tau']:.3f} | acc {accs} | "
            f"lr {m['lr']:.2e} | {_fmt_rate(m['tok_per_s'])} tok/s | {split_txt}{mem}")


class ConsumedSamples:
    """Which samples this drafter trained on, as count/sum/sum of squares of the dataset ids:
    enough to check 'every sample exactly once' across ranks without listing millions."""

    def __init__(self):
        self.count = self.total = self.squares = 0

    def add(self, batch: PackedBatch) -> None:
        ids = batch.sample_ids.tolist()
        self.count += len(ids)
        self.total += sum(ids)
        self.squares += sum(i * i for i in ids)

    def as_dict(self) -> dict:
        return {"samples": self.count, "sample_id_sum": self.total, "sample_id_sq_sum": self.squares}
