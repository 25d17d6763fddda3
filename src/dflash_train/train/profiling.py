"""`run.profile_steps`: where a few training steps' time goes, kernel by kernel.

torch.profiler records optimizer steps FIRST..LAST (1-based, inclusive; pick steps after the
first log window, which holds the compiles). Each step is one `train_step` range, and the
stages inside it are `forward`, `backward` and `optimizer` ranges. At LAST (or at the end
of a run that stops before it) the table of the ops and kernels with the most device time
(CPU time on a CPU run) is written to `<output_dir>/profile/steps-FIRST-LAST.txt`, with the
Chrome trace beside it (`trace.json`, for chrome://tracing or Perfetto) and, below the table,
where the device sat idle between kernels and why (`gpu_idle`). Only the main
drafter profiles; it slows the profiled steps only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from dflash_train.train import gpu_idle

log = logging.getLogger("dflash_train")


def parse_profile_steps(spec: str) -> tuple[int, int] | None:
    """'' -> None; 'A-B' or 'A' -> (A, B) with 1 <= A <= B."""
    if not spec:
        return None
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", spec.strip())
    if m is None:
        raise ValueError(f"run.profile_steps takes FIRST-LAST (optimizer steps, e.g. 21-23), got {spec!r}")
    span = int(m.group(1)), int(m.group(2) or m.group(1))
    if not 1 <= span[0] <= span[1]:
        raise ValueError(f"run.profile_steps needs 1 <= FIRST <= LAST, got {spec!r}")
    return span


class StepProfiler:
    """Starts torch.profiler when optimizer step FIRST begins, writes the table when LAST ends."""

    def __init__(self, spec: str, output_dir: Path, device: torch.device, *, enabled: bool, top: int = 40):
        self.span = parse_profile_steps(spec) if enabled else None
        self.dir = Path(output_dir) / "profile"
        self.cuda = device.type == "cuda"
        self.top = top
        self._prof: profile | None = None
        self._range: contextlib.AbstractContextManager | None = None

    def step_begins(self, step: int) -> None:
        """`step`: the 1-based number of the optimizer step about to run."""
        if self.span is None:
            return
        self._end_range()  # a skipped (non-finite) step never reached step_ended
        if step == self.span[0] and self._prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._prof = profile(activities=activities)
            self._prof.start()
        if self._prof is not None:
            self._range = record_function("train_step")
            self._range.__enter__()

    def step_ended(self, step: int) -> None:
        self._end_range()
        if self._prof is not None and step >= self.span[1]:
            self._write(step)

    def close(self, step: int) -> None:
        """The run ended (`step`: the last optimizer step done): write what was recorded if
        LAST was never reached."""
        self._end_range()
        if self._prof is not None:
            self._write(step)

    def _end_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def _write(self, step: int) -> None:
        prof, self._prof = self._prof, None
        if self.cuda:
            torch.cuda.synchronize()
        prof.stop()
        self.dir.mkdir(parents=True, exist_ok=True)
        first = self.span[0]
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        path = self.dir / f"steps-{first}-{step}.txt"
        table = prof.key_averages().table(sort_by=sort, row_limit=self.top, max_name_column_width=90)
        trace = self.dir / "trace.json"
        prof.export_chrome_trace(str(trace))
        idle = gpu_idle.report(gpu_idle.summarize(json.loads(trace.read_text())["traceEvents"]), step - first + 1)
        path.write_text(f"torch.profiler over optimizer steps {first}-{step}, sorted by {sort}\n{table}\n\n{idle}")
        log.info("profile of steps %d-%d: %s (and trace.json beside it)", first, step, path)
