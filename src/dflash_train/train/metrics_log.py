"""Where training metrics go: a progress bar, log lines, metrics.jsonl and TensorBoard."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from tqdm.auto import tqdm


def _fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}K" if x >= 1e3 else f"{x:.0f}"


class MetricsLogger:
    def __init__(self, output_dir: Path, *, total_steps: int, start_step: int, tensorboard: bool, progress: bool,
                 enabled: bool = True):
        self.enabled = enabled  # data-parallel replicas other than the main one record nothing
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"), purge_step=start_step + 1)
            except ImportError:  # tensorboard is a dependency, but stay usable without it
                print("tensorboard is not installed: metrics go to metrics.jsonl only", file=sys.stderr)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                        disable=not progress, file=sys.stderr)

    def truncate_after(self, step: int) -> None:
        """On resume, forget records of steps after the checkpoint (they will be redone)."""
        if not self.enabled or not self.path.is_file():
            return
        kept = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
        self.path.write_text("".join(ln + "\n" for ln in kept))

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

    def line(self, text: str) -> None:
        if not self.enabled or not text:
            return
        self.bar.write(text, file=sys.stderr) if not self.bar.disable else print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()


def format_train_line(step: int, total: int, m: dict[str, float], block_size: int) -> str:
    accs = " ".join(f"{m.get(f'acc_{k}', float('nan')):.2f}" for k in range(1, block_size))
    split = m.get("split", {})
    split_txt = " ".join(f"{k} {v:.0%}" for k, v in split.items())
    mem = f" | mem {m['peak_mem_gib']:.1f} GiB" if "peak_mem_gib" in m else ""
    return (f"step {step}/{total} | loss {m['loss']:.4f} ce {m['ce']:.3f} | tau {m['tau']:.3f} | acc {accs} | "
            f"lr {m['lr']:.2e} | {_fmt_rate(m['tok_per_s'])} tok/s | {split_txt}{mem}")
