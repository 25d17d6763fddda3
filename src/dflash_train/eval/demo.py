"""`dflash-train demo`: the whole pipeline on the built-in SmolLM2-135M-Instruct, offline.

    1. data     conversations SmolLM2 wrote itself (`dflash-train generate`), shipped in
                dflash_train/assets/demo_train.jsonl; held-out chat prompts checked disjoint
    2. prepare  tokenize with the chat template -> <output>/data
    3. train    the trainer with a config shipped as package data (demo_cpu.yaml /
                demo_gpu.yaml), time-boxed by run.max_minutes -> <output>/train
    4. export   the inference checkpoint -> <output>/drafter
    5. eval     speculative vs plain greedy decoding on held-out prompts -> <output>/eval

The target is loaded once (by the trainer) and reused for the evaluation. On 2 CPU cores
the default run takes under 10 minutes; `--quick` (what CI runs) about 2.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

MARKER = ".dflash-demo"
PROFILES = {
    # config, eval prompts, eval max new tokens
    "cpu": ("demo_cpu.yaml", 8, 96),
    "gpu": ("demo_gpu.yaml", 24, 256),
}
# --quick: a few steps, a couple of short prompts: checks the pipeline end to end
QUICK_OVERRIDES = {"run.max_steps": "3", "run.max_minutes": "0", "run.log_every": "1", "data.plan.token_budget": "512",
                   "step.num_anchors": "32", "data.eval_batches": "1", "optim.warmup_steps": "1"}
QUICK_EVAL = (2, 24)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", "-o", type=Path, default=Path("runs/demo"),
                        help="working directory (default runs/demo; a previous demo there is replaced)")
    parser.add_argument("--quick", action="store_true", help="a very short run (CI): a few steps, two prompts")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    parser.add_argument("--train-minutes", type=float, default=None,
                        help="time box of the training stage (default: the demo config's run.max_minutes)")
    parser.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts to decode")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="tokens generated per eval prompt")
    parser.add_argument("--threads", type=int, default=0,
                        help="CPU threads for torch (default: the cores other processes leave idle)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (log lines only)")


class DemoError(RuntimeError):
    pass


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


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
    from dflash_train.eval.assets import TRAIN_ASSET, overlap, read_jsonl
    from dflash_train.eval.prompts import CHAT_ASSET, asset_path

    train_path, held_path = asset_path(TRAIN_ASSET), asset_path(CHAT_ASSET)
    for p in (train_path, held_path):
        if not p.is_file():
            raise DemoError(f"{p} is missing: the package was installed without its data files")
    train, held = read_jsonl(train_path), read_jsonl(held_path)
    common = overlap(train, held)
    if common:
        raise DemoError(f"{len(common)} held-out prompts also occur in the training set, e.g. {sorted(common)[0]!r}")
    return train_path, len(train), len(held)


def main(args: argparse.Namespace) -> int:
    try:
        return run_demo(args)
    except DemoError as exc:
        print(f"dflash-train demo: error: {exc}", file=sys.stderr)
        return 2


def run_demo(args: argparse.Namespace) -> int:
    from dflash_train.data.prepare import PrepareConfig, prepare
    from dflash_train.drafter.checkpoint import load_drafter
    from dflash_train.eval.cli import resolve_device_dtype
    from dflash_train.eval.prompts import asset_path, load_prompts
    from dflash_train.eval.report import plot_report, summary_lines, write_json
    from dflash_train.eval.run import build_report, choose_cpu_threads, evaluate_prompts, make_proposer
    from dflash_train.train.config import TrainConfig
    from dflash_train.train.export_cli import export
    from dflash_train.train.trainer import Trainer, TrainingError, print_summary
    from dflash_train.utils.config import ConfigError, load_config

    start = time.perf_counter()
    device, _ = resolve_device_dtype(args.device, "auto")
    if device.type == "cpu":
        threads, why = choose_cpu_threads(args.threads)
        _say(f"CPU threads: {threads} ({why})")
    config_name, n_prompts, new_tokens = PROFILES["gpu" if device.type == "cuda" else "cpu"]
    if args.quick:
        n_prompts, new_tokens = QUICK_EVAL
    n_prompts = args.eval_prompts or n_prompts
    new_tokens = args.max_new_tokens or new_tokens
    progress = not args.no_progress
    out = args.output
    _prepare_output(out)

    def stage(i: int, text: str) -> None:
        _say(f"\n[{i}/5 | {time.perf_counter() - start:5.0f}s] {text}")

    stage(1, "data: conversations written by the built-in target SmolLM2-135M-Instruct itself")
    train_path, n_train, n_held = check_assets()
    _say(f"  {n_train} training conversations ({train_path.name}); {n_held} held-out chat prompts, none in the "
         f"training set")

    stage(2, f"prepare -> {out / 'data'}")
    manifest = prepare(PrepareConfig(target="builtin", inputs=[str(train_path)], output=str(out / "data"),
                                     max_length=1024, workers=1, overwrite=True, progress=progress))
    _say(f"  {manifest['counts']['rows_kept']} rows, {manifest['tokens']['total']:,} tokens "
         f"({manifest['tokens']['loss']:,} assistant tokens to learn)")

    overrides = {"data.path": str(out / "data"), "run.output_dir": str(out / "train"), "run.device": str(device),
                 "run.progress": str(progress).lower()}
    if args.quick:
        overrides.update(QUICK_OVERRIDES)
    if args.train_minutes is not None:
        overrides["run.max_minutes"] = str(args.train_minutes)
    try:
        cfg = load_config(TrainConfig, asset_path(config_name), overrides)
    except ConfigError as exc:
        raise DemoError(f"demo config: {exc}") from None
    budget = f"{cfg.run.max_minutes:g} min time box" if cfg.run.max_minutes else f"{cfg.run.max_steps} steps"
    stage(3, f"train ({config_name}, {budget}) -> {out / 'train'}")
    try:
        trainer = Trainer(cfg, log=_say)
        summary = trainer.fit()
    except TrainingError as exc:
        raise DemoError(str(exc)) from None
    print_summary(summary)
    if summary.get("interrupted_by"):  # Ctrl-C / SIGTERM: the trainer saved; the demo ends here
        _say(f"demo stopped by {summary['interrupted_by']}")
        return 130

    stage(4, f"export -> {out / 'drafter'}")
    drafter_dir = export(out / "train", out / "drafter")
    _say(f"  {drafter_dir}: config.json + model.safetensors (bf16)")

    stage(5, f"eval: speculative vs plain greedy decoding, {n_prompts} held-out prompts x {new_tokens} new tokens")
    trainer.runner.close()  # its hooks end target forwards early; decoding needs plain forwards
    drafter = load_drafter(drafter_dir)
    proposer = make_proposer(drafter, trainer.target)
    prompts = load_prompts("chat", n_prompts)
    results = evaluate_prompts(trainer.target, trainer.tokenizer, proposer, prompts, max_new_tokens=new_tokens,
                               progress=progress)
    report = build_report(results, proposer.block_size, target="builtin", drafter=str(drafter_dir), prompts="chat",
                          max_new_tokens=new_tokens, device=str(device),
                          dtype=str(trainer.target.dtype).removeprefix("torch."),
                          training_estimate=summary.get("eval", {}).get("tau"))
    json_path = write_json(report, out / "eval" / "report.json")
    png_path = plot_report(report, out / "eval" / "report.png", title="dflash-train demo: SmolLM2-135M-Instruct")

    o = report["overall"]
    lines = ["", "demo result", "-----------", *summary_lines(report)]
    estimate = summary.get("eval", {}).get("tau")
    if estimate is not None:
        lines.append(f"tau estimated during training (eval split, target labels): {estimate:.3f}; "
                     f"measured by speculative decoding: {o['tau']:.3f}; relative gap "
                     f"{(estimate - o['tau']) / o['tau']:+.1%}")
    lines += [f"report: {json_path}", f"figure: {png_path}",
              f"total time {time.perf_counter() - start:.0f}s"]
    print("\n".join(lines), flush=True)
    return 0
