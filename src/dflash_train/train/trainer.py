"""The drafter side of training: single process, or one drafter rank of a pipeline.

A run starts in two phases: the checks (train/checks.py: config, target config, data, run
folder, the checkpoint it resumes; nothing heavy loaded) and the build (target, drafter,
optimizer, schedule, resumed state, the components below). `fit` then runs steps, and each
component keeps its own time:

    StepLog       metrics_log.py  a log line every run.log_every steps and at the last step
    ScheduleFit   schedule.py     the schedule's length, fitted to run.max_minutes at log windows
    Evaluator     evaluate.py     every run.eval_every steps and at the end
    Checkpointer  checkpoint.py   every run.save_every steps, timed saves, and at the end
    StopControl   stopping.py     signals, the time box, stop requests: agreed every step

A step (`Trainer.train_step`) is accumulate -> agree -> apply:

    accumulate  for each of `grad_accum` micro-batches: batch (CPU, read ahead) + target taps
                (computed here, or received from a target rank) --> micro_step: anchors,
                labels, masks, forward, loss sums --> backward
    agree       one all-reduce between the drafter replicas carries the global loss weight and
                loss and the stop flags (train/stopping.py: all_reduce_weight_and_stop)
    apply       gradients divided by the global weight (the spec's global normalisation),
                clipped and applied, or the step skipped when not finite
Everything a resumed run needs is checkpointed (train/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch.profiler import record_function

from dflash_train.drafter.checkpoint import save_drafter
from dflash_train.drafter.loss import StepStats
from dflash_train.pipeline.context import DistContext
from dflash_train.pipeline.sources import BatchSource
from dflash_train.pipeline.target_worker import broadcast_start
from dflash_train.train import setup
from dflash_train.train.checkpoint import Checkpointer, TrainState, load_checkpoint
from dflash_train.train.checks import CheckedRun, check_run
from dflash_train.train.config import TrainConfig
from dflash_train.train.evaluate import Evaluator
from dflash_train.train.metrics_log import ConsumedSamples, MetricsLogger, StepLog
from dflash_train.train.optimizer import build_lr_scheduler, build_optimizer, build_param_groups
from dflash_train.train.profiling import StepProfiler
from dflash_train.train.run_files import resolved_config, write_run_config
from dflash_train.train.schedule import ScheduleFit
from dflash_train.train.step import StepKind, StepOutcome, apply_gradients, batch_seed, micro_step
from dflash_train.train.stopping import StopControl
from dflash_train.train.timing import StageTimer
from dflash_train.utils.device import resolve_device
from dflash_train.utils.errors import TrainingError
from dflash_train.utils.log import set_main_process
from dflash_train.utils.signals import StopSignals

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool | str = False, ctx: DistContext | None = None,
                 signals: StopSignals | None = None):
        self.signals = signals
        self.ctx = ctx or DistContext(layout="single", device=resolve_device(cfg.run.device))
        if not self.ctx.is_drafter:
            raise TrainingError(f"rank {self.ctx.rank} runs no drafter")
        self.main = self.ctx.is_main_drafter
        set_main_process(self.main)
        self.device = self.ctx.device
        self.output_dir = Path(cfg.run.output_dir)
        # ---- checks first: nothing heavy is loaded until the config is known to fit
        checked = check_run(cfg, self.ctx, resume)
        self.cfg, self.tokenizer, self.drafter_config = checked.cfg, checked.tokenizer, checked.drafter_config
        self.data, self.step_cfg = checked.data, checked.step_cfg
        self._announce(checked)
        # ---- then the build
        self._build_models(checked)
        self._build_optimizer(checked)
        self._resume(checked)
        self._build_components(checked)

    @property
    def total_steps(self) -> int:
        """The schedule's length now (run.fit_schedule may fit it to the time box mid-run)."""
        return self.schedule.total

    def _announce(self, checked: CheckedRun) -> None:
        cfg, d = self.cfg, self.drafter_config
        log.info("%s", self.data.planner.describe(0, world=self.ctx.num_drafters))
        if self.main:
            setup.announce_start(cfg, self.data.planner, self.device)
        log.info("target %s | drafter %d layers, block %d, taps %s, mask token %d | %d steps on %s", cfg.target.path,
                 d.num_hidden_layers, d.block_size, d.target_layer_ids, d.mask_token_id, checked.most_steps,
                 self.device)

    def _build_models(self, checked: CheckedRun) -> None:
        """The frozen target, the drafter, and what the step calls (the drafter data-parallel, compiled)."""
        cfg, ctx = self.cfg, self.ctx
        torch.manual_seed(cfg.run.seed)
        self.target = setup.load_frozen_target(cfg, self.drafter_config, self.device, whole_model=ctx.is_target,
                                               group=ctx.target_group)
        fresh = checked.resume_from is None
        self.drafter = setup.build_drafter(cfg, self.drafter_config, self.target.heads, self.device,
                                           init_layers=checked.init_layers if fresh else None,
                                           # a sharded target's layers are read from its files
                                           target_model=None if self.target.sharded else self.target.model)
        self.model = setup.wrap_drafter(self.drafter, ctx, compile=cfg.run.compile,
                                        autotune=cfg.run.compile_autotune)

    def _build_optimizer(self, checked: CheckedRun) -> None:
        """AdamW, and its learning-rate schedule over the schedule's length (ScheduleFit's `total`)."""
        cfg = self.cfg
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(build_param_groups(self.drafter, cfg.optim), cfg.optim,
                                         compiled=cfg.run.compile and cfg.optim.compiled_step)
        self.schedule = ScheduleFit(cfg.run, self.ctx, most_steps=checked.most_steps)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, lambda: self.total_steps)

    def _resume(self, checked: CheckedRun) -> None:
        """The state of a fresh run, or the checkpoint's (weights, optimizer, schedule, data cursor, RNG)."""
        self.state = TrainState()
        if checked.resume_from is None:
            return
        self.state = load_checkpoint(checked.resume_from, drafter=self.drafter, optimizer=self.optimizer,
                                     scheduler=self.scheduler)
        log.info("resumed from %s (step %d, data cursor epoch %d batch %d)", checked.resume_from, self.state.step,
                 self.state.epoch, self.state.index)
        if checked.init_layers:
            log.info("drafter.init_from_target=%s not applied: the run continues from its checkpoint's weights",
                     self.cfg.drafter.init_from_target)
        self.schedule.resumed(self.state.fitted_total)

    def _build_components(self, checked: CheckedRun) -> None:
        """The run's config file, the checkpointer and the evaluator; a split layout's target ranks are
        told where the data starts."""
        cfg, ctx, state = self.cfg, self.ctx, self.state
        # micro-batches of the whole run, when it ends with the data (the last step may be shorter)
        self.total_batches = None if cfg.run.max_steps else checked.most_steps * cfg.optim.grad_accum
        self.remaining_batches = (self.total_steps - state.step) * cfg.optim.grad_accum
        if ctx.layout == "split":
            broadcast_start(ctx, epoch=state.epoch, index=state.index, batches=self.remaining_batches)
        resolved = resolved_config(cfg, self.drafter_config, checked.init_layers, checked.data_identity)
        if self.main:
            write_run_config(self.output_dir, resolved, checked.resume_from)
        self.bad_in_a_row = 0
        self.consumed = ConsumedSamples()
        run = cfg.run
        self.checkpointer = Checkpointer(self.output_dir / "checkpoints", drafter=self.drafter,
                                         optimizer=self.optimizer, scheduler=self.scheduler, config=resolved,
                                         every=run.save_every, every_minutes=run.save_every_minutes,
                                         keep_last=run.keep_last, main=self.main, enabled=run.checkpoint)
        self.evaluator = Evaluator(cfg, self.data, self.target, self.tokenizer, self.step_cfg, self.device,
                                   padding=setup.compile_padding(cfg), num_drafters=ctx.num_drafters,
                                   enabled=self.main)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """The run's steps, its last checkpoint, then (unless interrupted) the final drafter and the
        evaluation; the run's summary."""
        state = self.state
        metrics = MetricsLogger(self.output_dir, total_steps=self.total_steps, start_step=state.step,
                                tensorboard=self.cfg.run.tensorboard, progress=self.cfg.run.progress and self.main,
                                enabled=self.main)
        metrics.truncate_after(state.step)
        source = setup.build_batch_source(self.cfg, self.ctx, self.data, self.target, self.drafter_config,
                                          start=(state.epoch, state.index), budget=self.remaining_batches)
        profiler = StepProfiler(self.cfg.run.profile_steps, self.output_dir, self.device, enabled=self.main)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with StopControl(self.cfg.run, self.ctx, elapsed_before_s=state.elapsed_s, signals=self.signals) as control:
            steps = StepLog(metrics, StageTimer(self.device), every=self.cfg.run.log_every,
                            block_size=self.drafter_config.block_size, group=self.ctx.drafters,
                            num_drafters=self.ctx.num_drafters, device=self.device, clock=control.session_elapsed_s)
            try:
                self._run_steps(source, steps, control, profiler)
            finally:
                profiler.close(state.step)
                source.close()
            state.elapsed_s = control.elapsed_s()
            path = self.checkpointer.maybe_save(state, metrics.line, last=True)
        return self._finish(metrics, control.reason, path, steps.last, source.stats())

    def _run_steps(self, source: BatchSource, steps: StepLog, control: StopControl, profiler: StepProfiler) -> None:
        """Steps until the schedule's end, the data's, or an agreed stop; each component at its own time."""
        state, metrics, exhausted = self.state, steps.metrics, False
        while state.step < self.total_steps and not exhausted:
            profiler.step_begins(state.step + 1)
            done = self.train_step(source, steps.timer, control)
            exhausted = done.exhausted
            if done.ends_run:
                break
            if done.kind is StepKind.NONFINITE:
                self._skip_nonfinite(metrics)
                continue
            self._count(done)
            profiler.step_ended(state.step)
            steps.step_done(state.step, done.micro, done.tokens)
            if steps.maybe_log(state.step, total=self.total_steps, lr=self.scheduler.get_last_lr()[0],
                               grad_norm=done.grad_norm):
                self._window_logged(control, metrics)
            self.evaluator.maybe_evaluate(self.drafter, state.step, metrics, self.tokens_seen)
            state.elapsed_s = control.elapsed_s()
            if done.shared.stop:
                break
            self.checkpointer.maybe_save(state, metrics.line, due=done.shared.save_due)

    def _window_logged(self, control: StopControl, metrics: MetricsLogger) -> None:
        """The schedule's time: a refitted length is the state a resumed run continues with."""
        fitted = self.schedule.window_logged(self.state.step, control.session_elapsed_s(), metrics)
        if fitted is not None:
            self.state.fitted_total = fitted

    def _count(self, done: StepOutcome) -> None:
        self.bad_in_a_row = 0
        self.state.step += 1
        self.state.tokens += done.tokens

    def train_step(self, source: BatchSource, timer: StageTimer, control: StopControl) -> StepOutcome:
        """One optimizer step: accumulate the micro-batches' gradients, agree with the other
        replicas on the global loss weight and on stopping, apply the normalised gradients."""
        state = self.state
        cursor = (state.epoch, state.index, state.batches)
        micro, tokens, redo, exhausted = self._accumulate(source, timer)
        if not micro:
            return StepOutcome(StepKind.NO_DATA, micro, tokens, exhausted)
        t = timer.start()
        shared = control.all_reduce_weight_and_stop(torch.stack([s.weight_sum for s in micro]).sum(),
                                                    torch.stack([s.loss_sum for s in micro]).sum(),
                                                    stop_requested=source.stop_requested, redo=redo,
                                                    save_due=self.checkpointer.timed_save_due())
        if shared.redo:  # placeholders from a stopping target: redo these batches after resume
            self.optimizer.zero_grad(set_to_none=True)
            state.epoch, state.index, state.batches = cursor
            return StepOutcome(StepKind.REDO, micro, tokens, exhausted, shared)
        with record_function("optimizer"):
            grad = apply_gradients(self.params, self.optimizer, self.scheduler, global_weight=shared.weight,
                                   global_loss=shared.loss, num_replicas=self.ctx.num_drafters,
                                   grad_clip=self.cfg.optim.grad_clip)
        timer.stop("optimizer", t)
        kind = StepKind.APPLIED if grad.applied else StepKind.NONFINITE
        return StepOutcome(kind, micro, tokens, exhausted, shared, grad.grad_norm)

    def _accumulate(self, source: BatchSource, timer: StageTimer) -> tuple[list[StepStats], int, bool, bool]:
        """Forward and backward of this step's micro-batches: (stats, tokens, redo, data exhausted)."""
        cfg, state = self.cfg, self.state
        n = cfg.optim.grad_accum
        if self.total_batches is not None:  # the last step of the data may be shorter
            n = max(1, min(n, self.total_batches - state.batches))
        micro, tokens, redo = [], 0, False
        for k in range(n):
            try:
                batch, target_out, placeholder = source.next(timer)
            except StopIteration:
                return micro, tokens, redo, True
            redo |= placeholder
            self.consumed.add(batch)
            state.epoch, state.index, state.batches = batch.epoch, batch.index + 1, state.batches + 1
            tokens += batch.num_tokens
            # gradients are all-reduced once per step, on its last micro-batch
            no_sync = self.model.no_sync() if hasattr(self.model, "no_sync") and k < n - 1 else contextlib.nullcontext()
            global_index = batch.index * self.ctx.num_drafters + (self.ctx.drafter_index if self.ctx.num_drafters > 1 else 0)
            with no_sync:
                micro.append(micro_step(self.model, self.target.heads, batch, target_out, step_cfg=self.step_cfg,
                                        loss_cfg=cfg.loss, device=self.device, timer=timer,
                                        seed=batch_seed(cfg.run.seed, batch.epoch, global_index)))
        return micro, tokens, redo, False

    def _skip_nonfinite(self, metrics: MetricsLogger) -> None:
        self.bad_in_a_row += 1
        self.state.bad_steps_total += 1
        step = self.state.step + 1
        metrics.line(f"step {step}: non-finite loss or gradient, step skipped "
                     f"({self.bad_in_a_row} in a row, {self.state.bad_steps_total} in all)")
        metrics.record(step, {"skipped_nonfinite": 1.0, "bad_in_a_row": float(self.bad_in_a_row)})
        if self.bad_in_a_row >= self.cfg.run.max_bad_steps:
            raise TrainingError(f"{self.bad_in_a_row} non-finite steps in a row (run.max_bad_steps="
                                f"{self.cfg.run.max_bad_steps}): lower optim.lr or check the data")

    # ------------------------------------------------------------------ the end
    @property
    def tokens_seen(self) -> int:
        """The run's training tokens so far, all drafters together."""
        return self.state.tokens * self.ctx.num_drafters

    def evaluate(self, metrics: MetricsLogger | None = None) -> dict:
        """Estimate and held-out measurement of tau at the current step (main drafter with a target only)."""
        return self.evaluator.evaluate(self.drafter, self.state.step, metrics, self.tokens_seen)

    def _finish(self, metrics: MetricsLogger, interrupted_by: str | None, path: Path | None, last: dict,
                transport: dict) -> dict:
        state = self.state
        # `last` (the last log window's metrics) carries its own tok_per_s: kept apart from the
        # run's average, which the summary line prints beside the run's tokens and seconds
        summary = {**last, "last_window_tok_per_s": last.get("tok_per_s"),
                   "steps": state.step, "tokens": self.tokens_seen, "elapsed_s": state.elapsed_s,
                   "tok_per_s": self.tokens_seen / max(state.elapsed_s, 1e-9), "checkpoint": str(path),
                   "interrupted_by": interrupted_by, "bad_steps": state.bad_steps_total,
                   "transport": transport, "consumed": self.consumed.as_dict()}
        if interrupted_by is None and state.step < self.total_steps:
            metrics.line(f"stopped at step {state.step} of {self.total_steps}: run.max_minutes="
                         f"{self.cfg.run.max_minutes} reached or the data ran out")
        if interrupted_by is None and self.main:
            if self.cfg.run.checkpoint:
                summary["final_drafter"] = str(save_drafter(self.drafter, self.output_dir / "final"))
            result = self.evaluate(metrics)
            summary["eval"] = result.get("estimate", {})
            if "measured" in result:
                summary["spec_eval"] = {**result["measured"], **result["comparison"]}
        metrics.close()
        return summary
