"""`dflash-train bench`: training throughput on synthetic batches, explained.

Runs the real trainer (any layout; under torchrun for several ranks) on a randomly
initialised target of a named real shape (`--preset`) and synthetic packed batches,
then prints and writes JSON with: sequence tokens/s, analytic model FLOPs per token
(target forward + drafter forward and backward, attention included), achieved TFLOP/s
and MFU against the matmul peaks measured in the same run, the better of a measurement
before and one after it (bf16; float8 too for the target's decoder matmuls when they run in
FP8), peak memory, and the time
split (data, queue wait, target, drafter forward, backward, optimizer).

    dflash-train bench --preset qwen3-8b --out bench.json
    torchrun --nproc-per-node 2 -m dflash_train bench --preset qwen3-8b --layout split \\
        --target-ranks 1 --drafter-ranks 1

`--levers all` (or a comma-separated list of names from levers.py) measures the levers of
the target forward (docs/performance.md, "The target forward") one row each, in one process,
and prints one table (target ms, drafter ms, tok/s, peak memory); the JSON, rewritten after
every row, holds them all.
`--append` adds the rows to the table already in `--out` (a table measured by several
processes); `--like TABLE.json` takes the settings of the fastest bf16 row of such a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from dflash_train.bench.flops import best_peaks, matmul_peaks_tflops, model_flops_utilisation, step_flops
from dflash_train.bench.levers import LEVERS, lever_names
from dflash_train.pipeline.context import exit_finished_rank, one_of_several_processes
from dflash_train.pipeline.report import targets_tokens_per_s
from dflash_train.target.presets import PresetName, preset_config
from dflash_train.train.config import TrainConfig
from dflash_train.train.run import run_rank
from dflash_train.train.setup import resolve_fast_path
from dflash_train.utils.config import from_dict, load_config, to_dict
from dflash_train.utils.device import resolve_device
from dflash_train.utils.errors import ConfigError, TrainingError
from dflash_train.utils.fs import check_writable_file

log = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    preset: PresetName = "qwen3-8b"
    """target shape (random weights; target/presets.py); llama3.3-70b, qwen3-235b-a22b and glm4.5-air
    need a group of ranks (--target-group-size)"""
    layout: Literal["single", "colocated", "split"] = "single"
    """rank layout (colocated and split under torchrun)"""
    target_ranks: int = 0
    """split: ranks running targets"""
    drafter_ranks: int = 0
    """split: ranks running drafters"""
    target_group_size: int = 1
    """pipeline.target_group_size: ranks holding one target between them (FSDP2), for one bigger than a GPU"""
    tokens: int = 8192
    """tokens per packed row (= per step and drafter)"""
    doc_len: str | None = None
    """document length LEN or LO-HI (default: one document per row)"""
    anchors: int = 512
    """anchors per row"""
    block: int = 16
    """block size"""
    layers: int = 5
    """drafter layers"""
    window: int = 2048
    """sliding window of the drafter layers (0 = full attention)"""
    labels: Literal["data", "target"] = "target"
    """label source"""
    compile: bool | Literal["auto"] = "auto"
    """fixed shapes + torch.compile of the drafter step (auto: on a GPU, as `train` decides it)"""
    drafter_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """drafter master weights (auto: bfloat16 on a GPU, float32 on a CPU)"""
    fp8_target: bool = False
    """float8 decoder matmuls in the target"""
    target_forward: Literal["auto", "hf", "packed"] = "auto"
    """target.forward: the Hugging Face forward or our packed layer loop (auto: packed on a GPU where it
    takes the target)"""
    target_compile: bool | Literal["auto"] = "auto"
    """target.compile: torch.compile the packed target forward (fixed shape; auto: with the packed
    forward on a GPU)"""
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math", "best"] = "auto"
    """target.sdpa_backend; best = the fastest of the sdpa rows measured before in a lever table"""
    overlap: bool = False
    """pipeline.overlap_target: the next batch's target forward on a second CUDA stream"""
    grouped_kv: bool | Literal["auto"] = "auto"
    """target.grouped_kv: the packed forward's attention takes one key/value head per group of query heads
    (auto: on for Gemma 2/3 in the packed forward)"""
    levers: str = ""
    """measure a lever table instead of one setting: 'all' or comma-separated lever names
    (dflash_train/bench/levers.py)"""
    append: bool = False
    """a lever table: add its rows to the table already in --out (one table from several processes)"""
    like: str | None = None
    """a lever table's JSON: run with the settings of its fastest bf16 row (target labels, no FP8)"""
    warmup: int = 5
    """steps excluded from the measurement"""
    measure: int = 10
    """measured steps (a multiple of warmup)"""
    queue_depth: int = 4
    """split: batches in flight per drafter"""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N"""
    out: str = "bench.json"
    """where the JSON result goes"""
    set: list[str] = field(default_factory=list)
    """any other training config override, KEY=VALUE"""
    profile: bool = False
    """after the measured steps, 3 more under torch.profiler (run.profile_steps): the top kernels
    go to OUT's name + .kernels.txt (the measured steps are not slowed by it)"""

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.measure < 1 or self.measure % self.warmup:
            raise ValueError("--measure must be a positive multiple of --warmup")
        bad = [item for item in self.set if "=" not in item]
        if bad:
            raise ValueError(f"--set takes KEY=VALUE, got {bad}")
        if self.profile and self.levers:
            raise ValueError("--profile profiles one setting: run it without --levers")
        if self.sdpa_backend == "best" and not self.levers:
            raise ValueError("--sdpa-backend best picks among the rows of a lever table: use it with --levers")
        unknown = [n for n in lever_names(self.levers) if n not in LEVERS]
        if unknown:
            raise ValueError(f"unknown levers {unknown}; known: {', '.join(LEVERS)}")


CONFIG = BenchConfig
PROFILED_STEPS = 3


def kernels_path(out: str) -> Path:
    return Path(out).with_suffix(".kernels.txt")


def build_config(args: BenchConfig, out_dir: Path) -> TrainConfig:
    doc = args.doc_len or str(args.tokens)
    steps = args.warmup + args.measure + (PROFILED_STEPS if args.profile else 0)
    overrides = {
        "target.path": f"preset:{args.preset}",
        "data.path": f"synthetic:{max(4096, steps * 8)}:{doc}",
        "data.plan.token_budget": str(args.tokens),
        "drafter.num_layers": str(args.layers), "drafter.block_size": str(args.block),
        "step.num_anchors": str(args.anchors), "step.label_source": args.labels,
        "run.max_steps": str(steps), "run.log_every": str(args.warmup), "run.save_every": str(10**9), "run.checkpoint": "false",
        "run.output_dir": str(out_dir), "run.compile": str(args.compile), "run.device": args.device,
        "run.drafter_dtype": args.drafter_dtype, "target.fp8": str(args.fp8_target), "run.tensorboard": "false", "run.progress": "false",
        "target.forward": args.target_forward, "target.compile": str(args.target_compile),
        "target.sdpa_backend": "auto" if args.sdpa_backend == "best" else args.sdpa_backend,
        "pipeline.overlap_target": str(args.overlap), "target.grouped_kv": str(args.grouped_kv),
        "optim.warmup_steps": "2", "pipeline.layout": args.layout, "pipeline.queue_depth": str(args.queue_depth),
        "pipeline.target_ranks": str(args.target_ranks), "pipeline.drafter_ranks": str(args.drafter_ranks),
        "pipeline.target_group_size": str(args.target_group_size),
    }
    if args.window:
        overrides["drafter.sliding_window"] = str(args.window)
    if args.profile:
        overrides["run.profile_steps"] = f"{steps - PROFILED_STEPS + 1}-{steps}"
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = value
    return load_config(TrainConfig, None, overrides)


def decide_auto_settings(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """`cfg` with its `auto` settings decided as `train` decides them for this preset on this device
    (train/setup.py resolve_fast_path), so that the result names what ran; the choice in one line."""
    cfg, line = resolve_fast_path(cfg, preset_config(cfg.target.path), device)
    if line:
        log.info("%s", line)
    return cfg


def measured_rows(args: BenchConfig, summary: dict, metrics: Path) -> list[dict]:
    """The run's metrics rows of the measured steps (after the warm-up); an error where a signal or
    a limit stopped the run before all of them."""
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()] if metrics.exists() else []
    measured = [r for r in rows if r["kind"] == "train" and args.warmup < r["step"] <= args.warmup + args.measure]
    if summary["steps"] < args.warmup + args.measure or not measured:
        raise TrainingError(f"bench: the run stopped at step {summary['steps']} (interrupted by "
                            f"{summary.get('interrupted_by') or 'a limit'}) before its measured steps "
                            f"{args.warmup + 1}-{args.warmup + args.measure} were done: nothing to report")
    return measured


def measure(args: BenchConfig, peaks: dict[str, float] | None = None) -> dict | None:
    """One setting: train on synthetic batches, return the result (None on a non-reporting rank)."""
    with tempfile.TemporaryDirectory(prefix="dflash-bench-") as tmp:  # the run's metrics, read here
        out_dir = Path(tmp)
        device = resolve_device(args.device, int(os.environ.get("LOCAL_RANK", 0)))  # this rank's GPU
        before = _peaks_before_run(args, device, peaks)
        cfg = decide_auto_settings(build_config(args, out_dir), device)
        summary = run_rank(cfg, resume=False)
        if summary is None:  # not the main drafter: it reports
            return None
        measured = measured_rows(args, summary, out_dir / "metrics.jsonl")
        if args.profile:
            kernels = next((out_dir / "profile").glob("steps-*.txt"))
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(kernels, kernels_path(args.out))
    tokens = sum(r["window_tokens"] for r in measured)
    seconds = sum(r["window_s"] for r in measured)
    steps = args.measure
    split = {k[5:-2]: sum(r.get(k, 0.0) for r in measured) / steps * 1000
             for k in measured[0] if k.startswith("time_") and k.endswith("_s")}
    flops = step_flops(cfg, args.preset)
    world = (cfg.pipeline.target_ranks + cfg.pipeline.drafter_ranks) if args.layout == "split" else \
        max(1, int(os.environ.get("WORLD_SIZE", 1)))
    drafters = cfg.pipeline.drafter_ranks if args.layout == "split" else world
    tok_s = drafters_tok_s = tokens / max(seconds, 1e-9)
    report = summary.get("pipeline") or {}
    targets_tok_s = targets_tokens_per_s(report, args.tokens)
    if targets_tok_s is not None:
        tok_s = min(tok_s, targets_tok_s)
    achieved = tok_s * flops["per_token"] / 1e12
    peaks = run_peaks(args, device, peaks, before)
    return {
        "preset": args.preset, "layout": args.layout, "world": world, "drafters": drafters,
        "compile": cfg.run.compile, "labels": args.labels, "fp8_target": args.fp8_target,
        "target_forward": cfg.target.forward, "target_compile": cfg.target.compile,
        "target_group_size": cfg.pipeline.target_group_size,
        "sdpa_backend": cfg.target.sdpa_backend, "overlap": cfg.pipeline.overlap_target,
        "grouped_kv": cfg.target.grouped_kv,
        "drafter_dtype": cfg.run.drafter_dtype, "tokens_per_step_per_drafter": args.tokens,
        "anchors": args.anchors, "block": args.block, "drafter_layers": args.layers, "window": args.window,
        "overrides": list(args.set), "steps_measured": steps, "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / world,
        "step_ms": seconds / steps * 1000, "time_split_ms_per_step": split,
        "flops_per_token": flops["per_token"], "flops_breakdown_per_token": flops["parts"],
        "achieved_tflops": achieved, "achieved_tflops_per_gpu": achieved / world,
        "matmul_peak_tflops": peaks and peaks["bf16"], "fp8_matmul_peak_tflops": peaks and peaks.get("fp8"),
        "mfu": model_flops_utilisation(flops, tok_s / world, peaks),
        "peak_mem_gib": measured[-1].get("peak_mem_gib"), "loss_last": measured[-1]["loss"],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "split_drafters_tokens_per_s": drafters_tok_s if targets_tok_s is not None else None,
        "split_targets_tokens_per_s": targets_tok_s,
        "pipeline": report.get("ranks"), "bottleneck": report.get("text"),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def _measures_peaks(args: BenchConfig, given: dict[str, float] | None) -> bool:
    """Whether a run measures its own matmul peaks (a lever table passes the ones it measured)."""
    return given is None or bool(args.fp8_target and "fp8" not in given)


def _peaks_before_run(args: BenchConfig, device: torch.device, given: dict[str, float] | None):
    """The matmul peaks measured before the run (None where the run does not measure its own), their
    buffers handed back to the GPU so the run's memory starts as it would without them."""
    if not _measures_peaks(args, given):
        return None
    peaks = matmul_peaks_tflops(device, fp8=args.fp8_target)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peaks


def run_peaks(args: BenchConfig, device: torch.device, given: dict[str, float] | None,
              before: dict[str, float] | None) -> dict[str, float] | None:
    """The matmul peaks a run's MFU is measured against: the lever table's (`given`), else the best of
    `before` the run and one measured now (flops.best_peaks); the float8 peak only where the target
    ran in FP8."""
    if _measures_peaks(args, given):
        given = best_peaks(before, matmul_peaks_tflops(device, fp8=args.fp8_target))
    return {k: v for k, v in given.items() if k == "bf16" or args.fp8_target} if given else None


LEVER_FIELDS = ("target_forward", "target_compile", "sdpa_backend", "overlap", "fp8_target", "labels", "grouped_kv")


def settings_of(args: BenchConfig) -> dict:
    """The lever fields of a setting (what a lever table row records and `--like` reads back)."""
    return {k: getattr(args, k) for k in LEVER_FIELDS}


def best_bf16_settings(path: str) -> dict:
    """The settings of the fastest row of a lever table that uses target labels and no FP8."""
    try:
        table = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--like {path}: not a lever table ({exc})") from None
    rows = table.get("rows") if isinstance(table, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("settings"), dict) for r in rows):
        raise ConfigError(f"--like {path}: not a lever table (a JSON object whose 'rows' each have 'settings', "
                          f"as `bench --levers` writes)")
    ok = [r for r in rows if isinstance(r.get("tokens_per_s"), (int, float)) and not r["settings"].get("fp8_target")
          and r["settings"].get("labels") == "target"]
    if not ok:
        raise ConfigError(f"--like {path}: no measured bf16 row with target labels")
    settings = max(ok, key=lambda r: r["tokens_per_s"])["settings"]
    unknown = sorted(set(settings) - set(LEVER_FIELDS))
    if unknown:
        raise ConfigError(f"--like {path}: the fastest row's settings hold {unknown}, not lever fields "
                          f"({', '.join(LEVER_FIELDS)})")
    return settings


def _fastest_sdpa(rows: list[dict]) -> str:
    """The SDPA kernel of the fastest target forward among the packed rows measured so far that
    differ only in it (auto when none of them ran)."""
    cands = [r for r in rows if "tokens_per_s" in r and r["name"] in ("packed", "packed-flash", "packed-cudnn")]
    if not cands:
        return "auto"
    return min(cands, key=lambda r: r["target_ms"])["settings"]["sdpa_backend"]


def _free_device_memory() -> float | None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated() / 2**30
    return None


def lever_row(name: str, r: dict) -> dict:
    """One measured row of a lever table; its settings as they ran (auto values decided)."""
    split = r["time_split_ms_per_step"]
    return {"name": name, "what": LEVERS[name][0], "settings": {k: r[k] for k in LEVER_FIELDS}, "tokens_per_s": r["tokens_per_s"],
            "step_ms": r["step_ms"], "target_ms": split.get("target", 0.0), "target_wait_ms": split.get("target_wait", 0.0),
            "drafter_ms": sum(split.get(k, 0.0) for k in ("forward", "backward", "optimizer")),
            "peak_mem_gib": r["peak_mem_gib"], "mfu": r["mfu"], "loss_last": r["loss_last"]}


def run_levers(args: BenchConfig) -> int:
    """Every lever of `args.levers` on top of `args`, one row each; the JSON after every row."""
    device = resolve_device(args.device)
    peaks = matmul_peaks_tflops(device, fp8=any(LEVERS[n][1].get("fp8_target") for n in lever_names(args.levers)))
    table = {"preset": args.preset, "base": {k: v for k, v in dataclasses.asdict(args).items() if k not in ("levers", "out")},
             "matmul_peak_tflops": peaks and peaks["bf16"], "fp8_matmul_peak_tflops": peaks and peaks.get("fp8"), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
             "torch": torch.__version__, "when": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": []}
    if args.append and Path(args.out).is_file():
        earlier = json.loads(Path(args.out).read_text())
        if earlier.get("preset") != args.preset:
            raise ConfigError(f"--append: {args.out} is a table of {earlier.get('preset')}, not {args.preset}")
        table["rows"] = earlier["rows"]
    for name in lever_names(args.levers):
        fields = dict(LEVERS[name][1])
        if fields.get("sdpa_backend", args.sdpa_backend) == "best":
            fields["sdpa_backend"] = _fastest_sdpa(table["rows"])
        variant = dataclasses.replace(args, levers="", **fields)
        settings = settings_of(variant)
        log.info("lever %s: %s", name, settings)
        t0 = time.perf_counter()
        try:
            r = measure(variant, peaks)
            row = lever_row(name, r) if r is not None else None
        except Exception as exc:  # one lever that cannot run (a kernel this GPU lacks) is a row, not the end
            log.exception("lever %s failed", name)
            row = {"name": name, "what": LEVERS[name][0], "settings": settings, "error": f"{type(exc).__name__}: {exc}"[:300]}
        if row is None:
            return 0  # not the reporting rank
        row["wall_s"] = time.perf_counter() - t0
        row["mem_left_gib"] = _free_device_memory()
        table["rows"].append(row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(table, indent=1))
        print(format_lever_table(table).splitlines()[-1], flush=True)  # this row; the table at the end
    print(format_lever_table(table), flush=True)
    return 0


def format_lever_table(table: dict) -> str:
    base = table["rows"][0] if table["rows"] and "tokens_per_s" in table["rows"][0] else None
    lines = [f"levers of the target forward | {table['preset']} | {table['device']}",
             "| lever | tok/s | vs first | step ms | target ms | target wait ms | drafter ms | peak GiB | wall s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in table["rows"]:
        if "error" in r:
            lines.append(f"| {r['name']} | failed: {r['error'][:80]} | | | | | | | {r['wall_s']:.0f} |")
            continue
        rel = f"{r['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base else ""
        lines.append(f"| {r['name']} | {r['tokens_per_s']:,.0f} | {rel} | {r['step_ms']:.1f} | {r['target_ms']:.1f} | "
                     f"{r['target_wait_ms']:.1f} | {r['drafter_ms']:.1f} | {r['peak_mem_gib'] or 0:.1f} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def run(args: BenchConfig, cli_args: argparse.Namespace | None = None) -> int:
    rc = _run(args)
    if one_of_several_processes():  # a torchrun rank: as `train` ends one (train/run.py)
        exit_finished_rank()
    return rc


def _run(args: BenchConfig) -> int:
    check_writable_file(args.out, option="--out")  # before the measurement, not after it
    if args.levers:
        return run_levers(args)
    if args.like:  # the table's values are checked like the command line's
        like = best_bf16_settings(args.like)
        try:
            args = from_dict(BenchConfig, {**to_dict(args), "like": None, **like})
        except ConfigError as exc:
            raise ConfigError(f"--like {args.like}: {exc}") from None
        log.info("settings of the fastest bf16 row of the lever table: %s", settings_of(args))
    result = measure(args)
    if result is None:
        return 0
    print(format_result(result))
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.profile:
        print(f"  profile         {kernels_path(args.out)} (steps after the measured ones):")
        print("\n".join(kernels_path(args.out).read_text().splitlines()[:28]))
    return 0


def _mfu_text(r: dict) -> str:
    if not r["mfu"]:
        return ""
    if r.get("fp8_matmul_peak_tflops"):
        return (f", MFU {r['mfu']:.1%} of the measured peaks (bf16 {r['matmul_peak_tflops']:.0f}, "
                f"fp8 {r['fp8_matmul_peak_tflops']:.0f} for the target's decoder matmuls)")
    return f", MFU {r['mfu']:.1%} of the measured peak (bf16 {r['matmul_peak_tflops']:.0f})"


def format_result(r: dict) -> str:
    target = f"target {r.get('target_forward', 'hf')}{' compiled' if r.get('target_compile') else ''}" \
             f"{' sharded over ' + str(r['target_group_size']) if r.get('target_group_size', 1) > 1 else ''}" \
             f"{' sdpa-' + r['sdpa_backend'] if r.get('sdpa_backend', 'auto') != 'auto' else ''}" \
             f"{' overlapped' if r.get('overlap') else ''}"
    lines = [f"bench {r['preset']} | layout {r['layout']} ({r['world']} rank(s)) | {'compiled' if r['compile'] else 'eager'}{' fp8-target' if r['fp8_target'] else ''} | {target} | "
             f"{r['labels']} labels | {r['tokens_per_step_per_drafter']} tokens x {r['drafters']} drafter(s)/step, "
             f"{r['anchors']} anchors, block {r['block']}, window {r['window']}",
             f"  tokens/s        {r['tokens_per_s']:,.0f} ({r['tokens_per_s_per_gpu']:,.0f} per rank), "
             f"{r['step_ms']:.1f} ms/step"
             + (f"\n  split           the lower of: the targets sustain {r['split_targets_tokens_per_s']:,.0f}, the "
                f"drafters measured {r['split_drafters_tokens_per_s']:,.0f}"
                if r.get("split_targets_tokens_per_s") else ""),
             f"  FLOPs/token     {r['flops_per_token'] / 1e9:.2f} GFLOP "
             + " ".join(f"{k} {v / 1e9:.2f}" for k, v in r["flops_breakdown_per_token"].items()),
             f"  achieved        {r['achieved_tflops_per_gpu']:.0f} TFLOP/s per rank"
             + _mfu_text(r),
             "  time/step (ms)  " + " ".join(f"{k} {v:.1f}" for k, v in r["time_split_ms_per_step"].items()),
             f"  peak memory     {r['peak_mem_gib'] or 0:.1f} GiB"]
    if r.get("bottleneck"):
        lines.append("  " + r["bottleneck"].replace("\n", "\n  "))
    return "\n".join(lines)

