"""`dflash-train demo`: the whole pipeline on the built-in SmolLM2-135M-Instruct, offline.

    1. data     conversations SmolLM2 wrote itself (`dflash-train generate`), shipped in
                dflash_train/assets/demo_train.jsonl; held-out chat prompts checked disjoint
    2. prepare  tokenize with the chat template -> <output>/data
    3. train    the trainer with a config shipped as package data (demo_cpu.yaml /
                demo_gpu.yaml), time-boxed by run.max_minutes -> <output>/train
    4. export   the inference checkpoint -> <output>/drafter
    5. eval     speculative vs plain greedy decoding on held-out prompts -> <output>/eval

The target is loaded once (by the trainer) and reused for the evaluation. How long it takes
(a CPU, a GPU, `--quick`) is measured in the README's table of run times; it ends with the
commands to try next.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.data.prompts import CHAT_ASSET, asset_path, load_prompts
from dflash_train.drafter.checkpoint import load_drafter
from dflash_train.eval.assets import TRAIN_ASSET, overlap, read_jsonl
from dflash_train.eval.report import cpu_cost_line, plot_report, summary_lines, write_json
from dflash_train.speculative.evaluate import build_report, evaluate_prompts
from dflash_train.train.config import TrainConfig
from dflash_train.train.export_cli import export
from dflash_train.train.run import print_summary
from dflash_train.train.trainer import Trainer
from dflash_train.utils.command import program
from dflash_train.utils.config import cli, load_config
from dflash_train.utils.device import choose_cpu_threads, resolve_device
from dflash_train.utils.errors import EXIT_INTERRUPTED, DFlashError

log = logging.getLogger(__name__)

MARKER = ".dflash-demo"
PROFILES = {
    # config, eval prompts, eval max new tokens, timings of each prompt (the speedup's median and spread)
    "cpu": ("demo_cpu.yaml", 8, 96, 2),
    "gpu": ("demo_gpu.yaml", 24, 256, 3),
}
# the registry of measured headline numbers (a source checkout has it; an installed package does not)
REGISTRY = Path(__file__).resolve().parents[3] / "bench" / "results" / "summary.json"
# what the recipe's SmolLM2-135M drafter measured on a GPU: registry key -> what it is
GPU_KEYS = {"quality.smollm2.tau_chat_heldout": "tau {:.2f} on held-out chat prompts",
            "quality.smollm2.tau_humaneval": "tau {:.2f} on HumanEval",
            "quality.smollm2.speedup_batch1": "{:.2f}x the speed of plain greedy decoding at batch 1 (HumanEval)"}
# --quick: a few steps, a couple of short prompts: checks the pipeline end to end
QUICK_OVERRIDES = {"run.max_steps": "3", "run.max_minutes": "0", "run.log_every": "1", "data.plan.token_budget": "512",
                   "step.num_anchors": "32", "data.eval_batches": "1", "optim.warmup_steps": "1"}
QUICK_EVAL = (2, 24, 2)


@dataclass
class DemoConfig:
    output: str = field(default="runs/demo", metadata=cli(aliases=("-o",)))
    """working directory (a previous demo there is replaced; any other directory is refused)"""
    quick: bool = False
    """a very short run (CI): a few steps, two prompts"""
    device: str = "auto"
    """auto (cuda if available), cpu, cuda"""
    train_minutes: float | None = None
    """time box of the training stage (default: the demo config's run.max_minutes; 0: none, the config's epochs)"""
    eval_prompts: int | None = None
    """held-out prompts to decode"""
    max_new_tokens: int | None = None
    """tokens generated per eval prompt"""
    threads: int = 0
    """CPU threads for torch (0: the cores other processes leave idle)"""
    progress: bool = True
    """show progress bars (--no-progress: log lines only)"""

    def __post_init__(self) -> None:  # checked at parse time, before anything is prepared
        if self.train_minutes is not None and self.train_minutes < 0:
            raise ValueError(f"--train-minutes must be >= 0 (0: no time box), got {self.train_minutes:g}")
        for name in ("eval_prompts", "max_new_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value} (the demo ends with its eval)")
        if self.threads < 0:
            raise ValueError(f"--threads must be >= 0, got {self.threads}")


CONFIG = DemoConfig


class DemoError(DFlashError):
    pass


def _prepare_output(out: Path) -> None:
    """A fresh working directory; only a previous demo's directory is ever deleted."""
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).is_file():
            raise DemoError(f"{out} exists and was not made by the demo: choose another --output")
        for name in ("data", "train", "drafter", "eval"):
            shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text("made by dflash-train demo; rerunning the demo replaces this directory\n")


def check_assets() -> tuple[Path, int, int]:
    """The shipped training set and held-out prompts exist and share no request."""
    train_path, held_path = asset_path(TRAIN_ASSET), asset_path(CHAT_ASSET)
    for p in (train_path, held_path):
        if not p.is_file():
            raise DemoError(f"{p} is missing: the package was installed without its data files")
    train, held = read_jsonl(train_path), read_jsonl(held_path)
    common = overlap(train, held)
    if common:
        raise DemoError(f"{len(common)} held-out prompts also occur in the training set, e.g. {sorted(common)[0]!r}")
    return train_path, len(train), len(held)


@dataclass
class _EvalPlan:
    config_name: str  # the shipped training config
    prompts: int
    new_tokens: int
    timing_repeats: int


def _plan(args: DemoConfig, device: torch.device) -> _EvalPlan:
    """The device's profile (a short run on a CPU), --quick's, then the options given."""
    config_name, n_prompts, new_tokens, repeats = PROFILES["gpu" if device.type == "cuda" else "cpu"]
    if args.quick:
        n_prompts, new_tokens, repeats = QUICK_EVAL
    return _EvalPlan(config_name, n_prompts if args.eval_prompts is None else args.eval_prompts,
                     new_tokens if args.max_new_tokens is None else args.max_new_tokens, repeats)


def run(args: DemoConfig, cli_args: argparse.Namespace | None = None) -> int:
    start = time.perf_counter()
    device = resolve_device(args.device)
    if device.type == "cpu":
        threads, why = choose_cpu_threads(args.threads)
        log.info("CPU threads: %d (%s)", threads, why)
    plan, out = _plan(args, device), Path(args.output)
    _prepare_output(out)

    def stage(i: int, text: str) -> None:
        log.info("\n[%d/5 | %5.0fs] %s", i, time.perf_counter() - start, text)

    stage(1, "data: conversations written by the built-in target SmolLM2-135M-Instruct itself")
    train_path, n_train, n_held = check_assets()
    log.info("  %d training conversations (%s); %d held-out chat prompts, none in the training set",
             n_train, train_path.name, n_held)

    stage(2, f"prepare -> {out / 'data'}")
    manifest = prepare(PrepareConfig(target="builtin", inputs=[str(train_path)], output=str(out / "data"),
                                     max_length=1024, workers=1, overwrite=True, progress=args.progress))
    log.info("  %d rows, %s tokens (%s assistant tokens to learn)", manifest["counts"]["rows_kept"],
             f"{manifest['tokens']['total']:,}", f"{manifest['tokens']['loss']:,}")

    cfg = _train_config(args, plan, out, device)
    budget = f"{cfg.run.max_minutes:g} min time box" if cfg.run.max_minutes else f"{cfg.run.max_steps} steps"
    stage(3, f"train ({plan.config_name}, {budget}) -> {out / 'train'}")
    trainer = Trainer(cfg)
    summary = trainer.fit()
    print_summary(summary)
    if summary.get("interrupted_by"):  # Ctrl-C / SIGTERM: the trainer saved; the demo ends here
        log.info("demo stopped by %s", summary["interrupted_by"])
        return EXIT_INTERRUPTED

    stage(4, f"export -> {out / 'drafter'}")
    drafter_dir = export(out / "train", out / "drafter")
    log.info("  %s: config.json + model.safetensors (bf16)", drafter_dir)

    stage(5, f"eval: speculative vs plain greedy decoding, {plan.prompts} held-out prompts x {plan.new_tokens} "
             f"new tokens")
    lines = _evaluate(trainer, summary, drafter_dir, plan, out, device, args.progress)
    print("\n".join([*lines, f"total time {time.perf_counter() - start:.0f}s", *next_lines(drafter_dir)]), flush=True)
    return 0


def _train_config(args: DemoConfig, plan: _EvalPlan, out: Path, device: torch.device) -> TrainConfig:
    overrides = {"data.path": str(out / "data"), "run.output_dir": str(out / "train"), "run.device": str(device),
                 "run.progress": str(args.progress).lower()}
    if args.quick:
        overrides.update(QUICK_OVERRIDES)
    if args.train_minutes is not None:
        overrides["run.max_minutes"] = str(args.train_minutes)
    return load_config(TrainConfig, asset_path(plan.config_name), overrides)


def _evaluate(trainer: Trainer, summary: dict, drafter_dir: Path, plan: _EvalPlan, out: Path,
              device: torch.device, progress: bool) -> list[str]:
    """Speculative against plain greedy decoding on the held-out prompts: the report written, its lines."""
    trainer.target.runner.close()  # its hooks end target forwards early; the generic decoding path needs plain ones
    target = trainer.target.model
    drafter = load_drafter(drafter_dir)
    results = evaluate_prompts(target, trainer.tokenizer, drafter, load_prompts("chat", plan.prompts),
                               max_new_tokens=plan.new_tokens, progress=progress, compile=device.type == "cuda",
                               timing_repeats=plan.timing_repeats)
    estimate = summary.get("eval", {}).get("tau")
    report = build_report(results, drafter.config.block_size, target="builtin", drafter=str(drafter_dir), prompts="chat",
                          max_new_tokens=plan.new_tokens, device=str(device),
                          dtype=str(target.dtype).removeprefix("torch."), training_estimate=estimate)
    json_path = write_json(report, out / "eval" / "report.json")
    png_path = plot_report(report, out / "eval" / "report.png", title="dflash-train demo: SmolLM2-135M-Instruct")
    o = report["overall"]
    lines = ["", "demo result", "-----------", *summary_lines(report)]
    if estimate is not None:
        lines.append(f"tau estimated during training (eval split, target labels): {estimate:.3f}; "
                     f"measured by speculative decoding: {o['tau']:.3f}; relative gap "
                     f"{(estimate - o['tau']) / o['tau']:+.1%}")
    return [*lines, *(cpu_lines(report, summary["steps"], drafter.config.num_hidden_layers) if device.type == "cpu" else []),
            *gpu_reference_lines(REGISTRY), f"report: {json_path}", f"figure: {png_path}"]


def next_lines(drafter_dir: Path) -> list[str]:
    """The commands to try after the demo, spelled as this one was started (`.venv/bin/dflash-train`,
    `dflash-train` on the PATH, or `python -m dflash_train`)."""
    dft = program()
    lines = ["", "next:",
             f"  {dft} eval --target builtin --drafter {drafter_dir} --prompts humaneval --num-prompts 4 "
             f"--max-new-tokens 128   # this drafter on code prompts"]
    if REGISTRY.is_file():  # a source checkout: the recipe's GPU-trained drafter is kept in its history
        lines.append("  bash scripts/recipe_data.sh restore-drafter drafters/smollm2-recipe   # a drafter trained on "
                     "a GPU, then the same eval with --drafter drafters/smollm2-recipe")
    lines.append("  README.md, \"Train a drafter for your model\": the same five steps on your own model and data")
    return lines


def cpu_lines(report: dict, steps: int, layers: int) -> list[str]:
    """What a CPU run shows, with this run's own costs: why its speedup is below 1."""
    cost = cpu_cost_line(report)
    return [f"what this CPU run shows: the whole pipeline and the measurement, not a useful drafter ({steps} steps "
            f"of a {layers}-layer drafter trained from scratch)", *([cost] if cost else [])]


def gpu_reference_lines(registry: Path) -> list[str]:
    """What a drafter for the same target, trained by the recipe on a GPU, measured (read from the
    registry). Numbers measured on another day or machine (a drafter kept since, not yet timed) are
    said with their own, so the line never passes one drafter's speed off as another's."""
    try:
        entries = json.loads(Path(registry).read_text())
        groups: dict[tuple[str, str], list[str]] = {}
        for key, what in GPU_KEYS.items():
            entry = entries[key]
            groups.setdefault((entry.get("device", "?"), entry.get("date", "?")), []).append(
                what.format(float(entry["value"])))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ["on a GPU: see bench/results/summary.json of the source repository (the registry of measured numbers)"]
    said = [f"{', '.join(parts)} ({device}, {date}" for (device, date), parts in groups.items()]
    who = "a drafter" if len(said) == 1 else "drafters"
    return [f"on a GPU, {who} for the same target trained by the recipe (docs/recipe-smollm2.md) measured "
            f"{'), and '.join(said)}; bench/results/summary.json)"]
