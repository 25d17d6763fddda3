"""One rank of a training job: pick the role, run it, report, shut down.

Failure policy: any exception on any rank propagates out of `run_rank`, the process exits
non-zero, and torchrun stops every other rank of the job (its default behaviour, within
seconds; the root cause is printed once, from the failing rank's error file: see
`dflash_train.cli`). A rank blocked on a dead peer that torchrun cannot see (another
node) fails by the process-group timeout, `pipeline.timeout_s`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from dflash_train.pipeline.context import DistContext, init_distributed, shutdown


def run_rank(cfg, *, resume: bool, log=print) -> dict | None:
    """Run this process's part; returns the training summary on the main drafter, else None."""
    from dflash_train.train.trainer import Trainer, TrainingError, resolve_device

    resolve_device(cfg.run.device)  # a clear error for device=cuda without CUDA
    try:
        ctx = init_distributed(cfg.pipeline, cfg.run.device)
    except ValueError as exc:
        raise TrainingError(str(exc)) from None
    try:
        if ctx.is_drafter:
            trainer = Trainer(cfg, resume=resume, log=log, ctx=ctx)
            summary = trainer.fit()
            mine = {"role": "drafter" if ctx.layout == "split" else ctx.layout, "rank": ctx.rank,
                    "steps": summary["steps"], "tok_per_s": summary["tok_per_s"], "wall_s": summary["elapsed_s"],
                    "batches": summary["steps"] * cfg.optim.grad_accum, **summary.get("transport", {}),
                    **summary.get("consumed", {})}
        else:
            from dflash_train.pipeline.target_worker import TargetWorker

            mine = TargetWorker(cfg, ctx, log=log).run()
            summary = None
        if ctx.distributed:
            everyone = [None] * ctx.world if ctx.is_main_drafter else None
            dist.gather_object(mine, everyone, dst=ctx.drafter_ranks[0], group=ctx.control)
            if ctx.is_main_drafter:
                report = pipeline_report(ctx, everyone)
                log(report["text"])
                Path(cfg.run.output_dir, "pipeline_stats.json").write_text(json.dumps(report, indent=1, default=str))
                summary["pipeline"] = report
        return summary if ctx.is_main_drafter else None
    finally:
        shutdown(ctx)


def pipeline_report(ctx: DistContext, ranks: list[dict]) -> dict:
    """Per-rank throughput and queue statistics, and which side limits the job."""
    lines = [f"pipeline: layout {ctx.layout}, {ctx.num_targets} target rank(s), {ctx.num_drafters} drafter rank(s)"]
    lines.append(f"{'rank':>4}  {'role':<9} {'batches':>8} {'tok/s':>10} {'queue wait':>11} {'mean fill':>9}")
    for r in sorted(ranks, key=lambda x: x["rank"]):
        wall = r.get("wall_s") or 0
        wait = r.get("queue_wait_s", 0.0)
        lines.append(f"{r['rank']:>4}  {r['role']:<9} {r.get('batches', r.get('steps', 0)):>8} "
                     f"{r.get('tok_per_s', 0):>10,.0f} {wait:>10.1f}s {r.get('mean_queue_fill', 0):>9.2f}")
    out = {"layout": ctx.layout, "ranks": ranks}
    if ctx.layout == "split":
        targets = [r for r in ranks if r["role"] == "target"]
        drafters = [r for r in ranks if r["role"] == "drafter"]
        t_wait = sum(r.get("queue_wait_s", 0) for r in targets) / max(len(targets), 1)
        d_wait = sum(r.get("queue_wait_s", 0) for r in drafters) / max(len(drafters), 1)
        # time a target needs per batch vs the time a drafter needs per batch (busy time only)
        # median work time per batch (queue waits, start-up and compilation excluded)
        t_per = sum(r.get("median_busy_ms_per_batch", 0) for r in targets) / max(len(targets), 1) / 1000
        d_per = sum(r.get("median_busy_ms_per_batch", 0) for r in drafters) / max(len(drafters), 1) / 1000
        side = "targets" if d_wait > t_wait else "drafters"
        world = ctx.num_targets + ctx.num_drafters
        balanced_t = max(1, min(world - 1, round(world * t_per / (t_per + d_per)))) if t_per + d_per > 0 else None
        conclusion = (f"bottleneck: the {side} (drafters waited {d_wait:.1f}s on empty queues, targets "
                      f"{t_wait:.1f}s on full ones); per batch a target needs {t_per * 1e3:.0f} ms and a drafter "
                      f"{d_per * 1e3:.0f} ms")
        if balanced_t is not None and d_per > 0:
            conclusion += f", so {balanced_t}:{world - balanced_t} (targets:drafters) would balance {world} ranks"
        lines.append(conclusion)
        out.update(bottleneck=side, target_ms_per_batch=t_per * 1e3, drafter_ms_per_batch=d_per * 1e3,
                   balanced_targets=balanced_t)
    out["text"] = "\n".join(lines)
    return out

