"""`dflash-train bench`: training throughput on synthetic batches, explained.

Runs the real trainer (any layout; under torchrun for several ranks) on a randomly
initialised target of a named real shape (`--preset`) and synthetic packed batches,
then prints and writes JSON with: sequence tokens/s, analytic model FLOPs per token
(target forward + drafter forward and backward, attention included), achieved TFLOP/s
and MFU against the bf16 matmul peak measured in the same run, peak memory, and the time
split (data, queue wait, target, drafter forward, backward, optimizer).

    dflash-train bench --preset qwen3-8b --out bench.json
    torchrun --nproc-per-node 2 -m dflash_train bench --preset qwen3-8b --layout split \\
        --target-ranks 1 --drafter-ranks 1
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from dflash_train.bench.flops import step_flops
from dflash_train.train.config import TrainConfig
from dflash_train.train.run import run_rank
from dflash_train.utils.config import load_config
from dflash_train.utils.device import resolve_device

log = logging.getLogger(__name__)


@dataclass
class BenchConfig:
    preset: Literal["smollm2-135m", "qwen3-8b", "dense-27b", "tiny"] = "qwen3-8b"
    """target shape (random weights)"""
    layout: Literal["single", "colocated", "split"] = "single"
    """rank layout (colocated and split under torchrun)"""
    target_ranks: int = 0
    """split: ranks running targets"""
    drafter_ranks: int = 0
    """split: ranks running drafters"""
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
    compile: bool = False
    """fixed shapes + torch.compile (compiled mode)"""
    drafter_dtype: Literal["float32", "bfloat16"] = "float32"
    """drafter master weights"""
    fp8_target: bool = False
    """float8 decoder matmuls in the target"""
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

    def __post_init__(self) -> None:
        if self.warmup < 1 or self.measure < 1 or self.measure % self.warmup:
            raise ValueError("--measure must be a positive multiple of --warmup")
        if self.layout == "split" and self.warmup <= self.queue_depth:
            # the batches the targets queue while the drafters start up would be measured as
            # drafter speed (a 3 + 6 step run measured 42.7K tok/s where the targets sustain 29K)
            raise ValueError(f"split: --warmup ({self.warmup}) must exceed --queue-depth ({self.queue_depth})")
        bad = [item for item in self.set if "=" not in item]
        if bad:
            raise ValueError(f"--set takes KEY=VALUE, got {bad}")


CONFIG = BenchConfig


def matmul_peak_tflops(device) -> float | None:
    """Measured bf16 dense matmul rate of this device (8192^3, median of 10), TFLOP/s."""
    if device.type != "cuda":
        return None
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * 8192**3 / sorted(times)[len(times) // 2] / 1e12


def build_config(args: BenchConfig, out_dir: Path) -> TrainConfig:
    doc = args.doc_len or str(args.tokens)
    steps = args.warmup + args.measure
    overrides = {
        "target.path": f"preset:{args.preset}",
        "data.path": f"synthetic:{max(4096, steps * 8)}:{doc}",
        "data.plan.token_budget": str(args.tokens),
        "drafter.num_layers": str(args.layers), "drafter.block_size": str(args.block),
        "step.num_anchors": str(args.anchors), "step.label_source": args.labels,
        "run.max_steps": str(steps), "run.log_every": str(args.warmup), "run.save_every": str(10**9), "run.checkpoint": "false",
        "run.output_dir": str(out_dir), "run.compile": str(args.compile), "run.device": args.device,
        "run.drafter_dtype": args.drafter_dtype, "target.fp8": str(args.fp8_target), "run.tensorboard": "false", "run.progress": "false",
        "optim.warmup_steps": "2", "pipeline.layout": args.layout, "pipeline.queue_depth": str(args.queue_depth),
        "pipeline.target_ranks": str(args.target_ranks), "pipeline.drafter_ranks": str(args.drafter_ranks),
    }
    if args.window:
        overrides["drafter.sliding_window"] = str(args.window)
    for item in args.set:
        key, _, value = item.partition("=")
        overrides[key] = value
    return load_config(TrainConfig, None, overrides)


def run(args: BenchConfig, cli_args: argparse.Namespace | None = None) -> int:
    out_dir = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    cfg = build_config(args, out_dir)
    summary = run_rank(cfg, resume=False)
    if summary is None:  # not the main drafter: it reports
        return 0
    rows = [json.loads(ln) for ln in (out_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    measured = [r for r in rows if r["kind"] == "train" and r["step"] > args.warmup]
    tokens = sum(r["window_tokens"] for r in measured)
    seconds = sum(r["window_s"] for r in measured)
    steps = args.measure
    split = {k[5:-2]: sum(r.get(k, 0.0) for r in measured) / steps * 1000
             for k in measured[0] if k.startswith("time_") and k.endswith("_s")}
    device = resolve_device(args.device)
    flops = step_flops(cfg, args.preset)
    world = (cfg.pipeline.target_ranks + cfg.pipeline.drafter_ranks) if args.layout == "split" else \
        max(1, int(os.environ.get("WORLD_SIZE", 1)))
    drafters = cfg.pipeline.drafter_ranks if args.layout == "split" else world
    tok_s = tokens / max(seconds, 1e-9)
    achieved = tok_s * flops["per_token"] / 1e12
    peak = matmul_peak_tflops(device)
    result = {
        "preset": args.preset, "layout": args.layout, "world": world, "drafters": drafters,
        "compile": args.compile, "labels": args.labels, "fp8_target": args.fp8_target,
        "drafter_dtype": args.drafter_dtype, "tokens_per_step_per_drafter": args.tokens,
        "anchors": args.anchors, "block": args.block, "drafter_layers": args.layers, "window": args.window,
        "steps_measured": steps, "tokens_per_s": tok_s, "tokens_per_s_per_gpu": tok_s / world,
        "step_ms": seconds / steps * 1000, "time_split_ms_per_step": split,
        "flops_per_token": flops["per_token"], "flops_breakdown_per_token": flops["parts"],
        "achieved_tflops": achieved, "achieved_tflops_per_gpu": achieved / world,
        "matmul_peak_tflops": peak, "mfu": (achieved / world / peak) if peak else None,
        "peak_mem_gib": measured[-1].get("peak_mem_gib"), "loss_last": measured[-1]["loss"],
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "pipeline": (summary.get("pipeline") or {}).get("ranks"),
        "bottleneck": (summary.get("pipeline") or {}).get("text"),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(format_result(result))
    return 0


def format_result(r: dict) -> str:
    lines = [f"bench {r['preset']} | layout {r['layout']} ({r['world']} rank(s)) | {'compiled' if r['compile'] else 'eager'}{' fp8-target' if r['fp8_target'] else ''} | "
             f"{r['labels']} labels | {r['tokens_per_step_per_drafter']} tokens x {r['drafters']} drafter(s)/step, "
             f"{r['anchors']} anchors, block {r['block']}, window {r['window']}",
             f"  tokens/s        {r['tokens_per_s']:,.0f} ({r['tokens_per_s_per_gpu']:,.0f} per rank), "
             f"{r['step_ms']:.1f} ms/step",
             f"  FLOPs/token     {r['flops_per_token'] / 1e9:.2f} GFLOP "
             + " ".join(f"{k} {v / 1e9:.2f}" for k, v in r["flops_breakdown_per_token"].items()),
             f"  achieved        {r['achieved_tflops_per_gpu']:.0f} TFLOP/s per rank"
             + (f", MFU {r['mfu']:.1%} of measured {r['matmul_peak_tflops']:.0f}" if r["mfu"] else ""),
             "  time/step (ms)  " + " ".join(f"{k} {v:.1f}" for k, v in r["time_split_ms_per_step"].items()),
             f"  peak memory     {r['peak_mem_gib'] or 0:.1f} GiB"]
    if r.get("bottleneck"):
        lines.append("  " + r["bottleneck"].replace("\n", "\n  "))
    return "\n".join(lines)

