"""One process of a training job: pick its role, run it, report, shut down.

Single process, or one rank of a torchrun job: a drafter rank runs the `Trainer` (the
target too, in the single and colocated layouts); a target rank of the split layout runs
a `TargetWorker`. The main drafter gathers every rank's numbers into the pipeline report.

Stops: SIGINT/SIGTERM are recorded from the moment the process starts until it ends (one
recorder for the whole process, utils/signals.py), so a signal that comes while a model
loads, a graph compiles or the last checkpoint is written is never fatal: the ranks agree
on it at the next step boundary (train/stopping.py), the main drafter writes one
checkpoint, and every rank exits 0. (A rank with no handler dies at once on SIGTERM and
leaves its peers blocked in a collective until torchrun kills them: no checkpoint.)

Failures: any exception on any rank propagates out of `run_rank` and the process exits
non-zero; torchrun stops the other ranks of its node. A rank that dies or freezes is
noticed by the others themselves (pipeline/heartbeat.py): each exits with code 3 naming
it, on any node, with or without torchrun.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path

import torch.distributed as dist

from dflash_train.data.splits import open_data
from dflash_train.pipeline.context import (DistContext, exit_finished_rank, init_distributed,
                                           one_of_several_processes, shutdown)
from dflash_train.pipeline.report import pipeline_report, targets_tokens_per_s
from dflash_train.pipeline.target_group import GroupTargetWorker
from dflash_train.pipeline.target_worker import TargetWorker
from dflash_train.target.loading import load_target_model, open_target, tokenizer_identity
from dflash_train.target.sharded import load_sharded_target
from dflash_train.train import setup
from dflash_train.train.config import TrainConfig
from dflash_train.train.stopping import STOP_ANNOUNCE
from dflash_train.train.trainer import Trainer
from dflash_train.utils.device import choose_cpu_threads, resolve_device, resolve_dtype
from dflash_train.utils.errors import DFlashError
from dflash_train.utils.fs import exclusive_directory
from dflash_train.utils.log import set_main_process
from dflash_train.utils.signals import StopSignals

log = logging.getLogger(__name__)


def build_target_worker(cfg: TrainConfig, ctx: DistContext, signals: StopSignals | None = None) -> TargetWorker:
    """A split layout's target rank: the same data and drafter config as the drafters, the whole target."""
    set_main_process(False)
    target_config, tokenizer = open_target(cfg.target.path, trust_remote_code=cfg.target.trust_remote_code)
    cfg, _ = setup.resolve_fast_path(cfg, target_config, ctx.device)  # as the drafters decide it (and say it)
    drafter_config = setup.resolve_drafter_config(cfg, target_config, tokenizer)
    setup.check_target_options(cfg, target_config)
    data = open_data(cfg.data, seed=cfg.run.seed, vocab_size=drafter_config.vocab_size,
                     tokenizer_identity=tokenizer_identity(tokenizer) if tokenizer is not None else None)
    t0 = time.perf_counter()
    t = cfg.target
    if ctx.target_group is not None:  # one shard of a target the group holds between them
        model = load_sharded_target(t.path, dtype=resolve_dtype(t.dtype, ctx.device), device=ctx.device,
                                    group=ctx.target_group, trust_remote_code=t.trust_remote_code,
                                    attn_implementation=t.attn_implementation, fp8=t.fp8)
        return GroupTargetWorker(ctx, setup.build_target_runner(cfg, model, drafter_config), data,
                                 queue_depth=cfg.pipeline.queue_depth, padding=setup.compile_padding(cfg),
                                 load_s=time.perf_counter() - t0, signals=signals)
    model = load_target_model(t.path, dtype=resolve_dtype(t.dtype, ctx.device), device=ctx.device,
                              trust_remote_code=t.trust_remote_code, attn_implementation=t.attn_implementation,
                              fp8=t.fp8)
    runner = setup.build_target_runner(cfg, model, drafter_config)
    return TargetWorker(ctx, runner, data, queue_depth=cfg.pipeline.queue_depth,
                        padding=setup.compile_padding(cfg), load_s=time.perf_counter() - t0, signals=signals)


def run_rank(cfg: TrainConfig, *, resume: bool | str) -> dict | None:
    """Run this process's part; returns the training summary on the main drafter, else None."""
    resolve_device(cfg.run.device)  # a clear error for device=cuda without CUDA, before any collective
    with StopSignals(announce=STOP_ANNOUNCE) as signals:
        ctx = init_distributed(cfg.pipeline, cfg.run.device)
        # one run per folder: a second start would interleave its steps and checkpoints with this one's
        folder = exclusive_directory(cfg.run.output_dir, job="train", option="run.output_dir") \
            if ctx.is_main_drafter else contextlib.nullcontext()
        try:
            with folder:
                return _run_role(cfg, ctx, resume=resume, signals=signals)
        except Exception as exc:
            # a collective that failed because a peer died: let the heartbeat name it (and end
            # this rank with the peer-lost code) rather than print a socket error
            if ctx.heartbeat is not None and not isinstance(exc, DFlashError):
                ctx.heartbeat.wait_for_verdict()
            raise
        finally:
            shutdown(ctx)


def _run_role(cfg: TrainConfig, ctx: DistContext, *, resume: bool | str, signals: StopSignals) -> dict | None:
    if ctx.device.type == "cpu":
        threads, why = choose_cpu_threads(cfg.run.threads)
        log.debug("CPU threads: %d (%s)", threads, why)
    if ctx.is_drafter:
        summary = Trainer(cfg, resume=resume, ctx=ctx, signals=signals).fit()
        mine = {"role": "drafter" if ctx.layout == "split" else ctx.layout, "rank": ctx.rank,
                "steps": summary["steps"], "tok_per_s": summary["tok_per_s"], "wall_s": summary["elapsed_s"],
                "batches": summary["steps"] * cfg.optim.grad_accum, **summary.get("transport", {}),
                **summary.get("consumed", {})}
    else:
        mine = build_target_worker(cfg, ctx, signals).run()
        summary = None
    if ctx.distributed:
        everyone = [None] * ctx.world if ctx.is_main_drafter else None
        dist.gather_object(mine, everyone, dst=ctx.drafter_ranks[0], group=ctx.control)
        if ctx.is_main_drafter:
            report = pipeline_report(ctx, everyone)
            log.info("%s", report["text"])
            Path(cfg.run.output_dir, "pipeline_stats.json").write_text(json.dumps(report, indent=1, default=str))
            summary["pipeline"] = report
    return summary if ctx.is_main_drafter else None


def run_training(cfg: TrainConfig, *, resume: bool | str) -> int:
    summary = run_rank(cfg, resume=resume)
    if summary is not None:
        print_summary(summary)
    if one_of_several_processes():
        exit_finished_rank()
    return 0


def print_summary(summary: dict) -> None:
    lines = ["", "training summary", "----------------"]
    window = summary.get("last_window_tok_per_s")
    lines.append(f"steps {summary['steps']}, {summary['tokens']:,} tokens in {summary['elapsed_s']:.1f}s "
                 f"({summary['tok_per_s']:,.0f} tok/s" + (f"; last log window {window:,.0f})" if window else ")"))
    pipe = summary.get("pipeline") or {}
    batches = sum(r.get("batches", 0) for r in pipe.get("ranks") or [] if r.get("role") == "drafter")
    sustained = targets_tokens_per_s(pipe, summary["tokens"] / batches) if batches else None
    if sustained is not None and window and window > 1.05 * sustained:  # a start-up stock, not bf16 jitter
        lines.append(f"split: the targets sustain {sustained:,.0f} tok/s; the last window's rate includes "
                     f"batches they queued while the drafters started (it falls to that in a longer run)")
    if "loss" in summary:
        lines.append(f"last window: loss {summary['loss']:.4f}, tau {summary['tau']:.3f} ({summary.get('labels', 0):,.0f} labels)")
    if summary.get("eval"):
        e = summary["eval"]
        lines.append(f"eval (target labels): tau {e['tau']:.3f}, acc_1 {e.get('acc_1', float('nan')):.3f}")
    if summary.get("spec_eval"):
        measured = summary["spec_eval"]["tau"]
        line = f"tau by speculative decoding ({summary['spec_eval']['prompts']} held-out prompts): {measured:.3f}"
        if summary.get("eval"):
            estimate = summary["eval"]["tau"]
            line += f"; training estimate {estimate:.3f} (target labels), relative gap {(estimate - measured) / measured:+.1%}"
        lines.append(line)
    if summary.get("bad_steps"):
        lines.append(f"skipped non-finite steps: {summary['bad_steps']}")
    lines.append(f"checkpoint: {summary['checkpoint']}")
    if summary.get("final_drafter"):
        lines.append(f"drafter (inference format): {summary['final_drafter']}")
    if summary.get("interrupted_by"):
        lines.append(f"stopped by {summary['interrupted_by']}: continue with --resume")
    print("\n".join(lines), flush=True)
