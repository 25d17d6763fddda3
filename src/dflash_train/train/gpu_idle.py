"""Where the GPU waits: idle gaps on a profiled step's device timeline, and who caused them.

A step's wall time is its kernels' time plus the time the GPU sat idle between them, which the
kernel table cannot show. From the Chrome trace torch.profiler writes, this merges every kernel,
memcpy and memset into busy intervals, and for each idle gap names the kernels on either side,
the CPU ranges the next kernel was launched from (`train_step > forward > aten::nonzero` says the
host was busy there while the device waited) and the longest blocking CUDA call (a synchronize or
a device-to-host copy) that ended inside the gap, the usual reason the host was late.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_RANGE_CATEGORIES = ("cpu_op", "user_annotation")
RUNTIME_CATEGORIES = ("cuda_runtime", "cuda_driver")
BLOCKING_CALLS = ("Synchronize", "cudaMemcpy", "cuMemcpy")  # name fragments of calls that wait on the device


@dataclass
class _Range:
    name: str
    start: float
    end: float
    children: list[_Range] = field(default_factory=list)
    child_starts: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Gap:
    start_us: float
    idle_us: float
    before: str  # the device op that ended at the gap's start
    after: str  # the device op that began at its end
    launched_in: str  # host ranges around the launch of `after`, outermost first
    waited_in: str  # the longest blocking CUDA call that ended inside the gap ('' = none)


@dataclass(frozen=True)
class IdleSummary:
    window_us: float  # first device op's start to last one's end
    busy_us: float  # union of device ops
    gaps: list[Gap]  # every gap, in time order

    @property
    def idle_us(self) -> float:
        return self.window_us - self.busy_us


def _nest(ranges: list[_Range]) -> list[_Range]:
    """One thread's host ranges as a forest (ranges on one thread nest)."""
    roots: list[_Range] = []
    stack: list[_Range] = []
    for r in sorted(ranges, key=lambda r: (r.start, -r.end)):
        while stack and stack[-1].end <= r.start:
            stack.pop()
        (stack[-1].children if stack else roots).append(r)
        stack.append(r)
    for r in ranges:
        r.child_starts = [c.start for c in r.children]
    return roots


def _stack_at(roots: list[_Range], ts: float) -> list[str]:
    """Names of the ranges containing `ts`, outermost first."""
    names: list[str] = []
    level, starts = roots, [r.start for r in roots]
    while level:
        i = bisect.bisect_right(starts, ts) - 1
        if i < 0 or level[i].end <= ts:
            break
        names.append(level[i].name)
        level, starts = level[i].children, level[i].child_starts
    return names


def summarize(events: list[dict]) -> IdleSummary | None:
    """`events`: a Chrome trace's `traceEvents`. None when it holds no device ops (a CPU run)."""
    device = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_CATEGORIES),
                    key=lambda e: e["ts"])
    if not device:
        return None
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in RUNTIME_CATEGORIES and "correlation" in e.get("args", {})}
    blocking = sorted((e for e in events if e.get("cat") in RUNTIME_CATEGORIES
                       and any(b in e["name"] for b in BLOCKING_CALLS)), key=lambda e: e["ts"] + e["dur"])
    blocking_ends = [e["ts"] + e["dur"] for e in blocking]
    per_thread: dict[object, list[_Range]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in HOST_RANGE_CATEGORIES:
            per_thread[(e.get("pid"), e.get("tid"))].append(_Range(e["name"], e["ts"], e["ts"] + e["dur"]))
    forests = {key: _nest(ranges) for key, ranges in per_thread.items()}

    gaps: list[Gap] = []
    busy = 0.0
    cur_start, cur_end, cur_last = device[0]["ts"], device[0]["ts"] + device[0]["dur"], device[0]
    for e in device[1:]:
        if e["ts"] > cur_end:
            busy += cur_end - cur_start
            gaps.append(_explain(cur_end, cur_last, e, launches, forests, blocking, blocking_ends))
            cur_start, cur_end, cur_last = e["ts"], e["ts"] + e["dur"], e
        elif e["ts"] + e["dur"] >= cur_end:
            cur_end, cur_last = e["ts"] + e["dur"], e
    busy += cur_end - cur_start
    return IdleSummary(window_us=cur_end - device[0]["ts"], busy_us=busy, gaps=gaps)


def _explain(start: float, before: dict, after: dict, launches: dict, forests: dict,
             blocking: list[dict], blocking_ends: list[float]) -> Gap:
    launch = launches.get(after.get("args", {}).get("correlation"))
    where = "?"
    if launch is not None:
        where = " > ".join(_stack_at(forests.get((launch.get("pid"), launch.get("tid")), []), launch["ts"])) or "(no range)"
    end = after["ts"]
    lo, hi = bisect.bisect_right(blocking_ends, start), bisect.bisect_right(blocking_ends, end)
    waits = blocking[lo:hi]
    waited = max(waits, key=lambda e: e["dur"])["name"] if waits else ""
    return Gap(start_us=start, idle_us=end - start, before=before["name"], after=after["name"],
               launched_in=where, waited_in=waited)


def report(summary: IdleSummary | None, steps: int, *, min_gap_us: float = 10.0, top: int = 12) -> str:
    """The summary as text: totals per step, idle grouped by launch site, the largest gaps."""
    if summary is None:
        return "GPU idle: no device ops in the trace (a CPU run)\n"
    per_step = 1e-3 / steps
    lines = [f"GPU timeline over {steps} step(s): {summary.window_us * per_step:.2f} ms per step, "
             f"busy {summary.busy_us * per_step:.2f}, idle {summary.idle_us * per_step:.2f} "
             f"({100 * summary.idle_us / summary.window_us:.1f}%) in {len(summary.gaps)} gaps"]
    big = [g for g in summary.gaps if g.idle_us >= min_gap_us]
    small = sum(g.idle_us for g in summary.gaps if g.idle_us < min_gap_us)
    groups: dict[tuple[str, str], list[Gap]] = defaultdict(list)
    for g in big:
        groups[(g.launched_in, g.waited_in)].append(g)
    lines.append(f"idle by launch site of the next kernel (gaps >= {min_gap_us:g} us; "
                 f"{small * per_step:.2f} ms per step in smaller gaps):")
    lines.append(f"  {'ms/step':>8} {'gaps':>5}  launched in [after a blocking call]")
    ranked = sorted(groups.items(), key=lambda kv: -sum(g.idle_us for g in kv[1]))
    for (where, waited), gs in ranked[:top]:
        note = f"  [after {waited}]" if waited else ""
        lines.append(f"  {sum(g.idle_us for g in gs) * per_step:8.3f} {len(gs):5d}  {where}{note}")
    lines.append("largest gaps (us, kernel before -> kernel after):")
    for g in sorted(big, key=lambda g: -g.idle_us)[:top]:
        lines.append(f"  {g.idle_us:9.1f}  {g.before[:60]} -> {g.after[:60]}  | {g.launched_in}"
                     + (f"  [after {g.waited_in}]" if g.waited_in else ""))
    return "\n".join(lines) + "\n"
