"""The drafter side of training: single process, or one drafter rank of a pipeline.

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
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from torch.profiler import record_function

from dflash_train.data.prompts import load_prompts
from dflash_train.data.splits import open_data
from dflash_train.drafter.checkpoint import growth, load_drafter_config, save_drafter
from dflash_train.drafter.loss import StepStats
from dflash_train.drafter.step import StepConfig
from dflash_train.pipeline.context import DistContext
from dflash_train.pipeline.target_worker import broadcast_start
from dflash_train.target.loading import open_target, tokenizer_identity
from dflash_train.train import setup
from dflash_train.train.checkpoint import (
    TrainState,
    checkpoint_to_resume,
    load_checkpoint,
    save_checkpoint,
    step_dir_name,
    verify_checkpoint,
)
from dflash_train.train.config import TrainConfig
from dflash_train.train.evaluate import Evaluator
from dflash_train.train.metrics_log import (STAGES, ConsumedSamples, MetricsLogger, Window, first_step_line,
                                            format_train_line, read_records)
from dflash_train.train.optimizer import build_lr_scheduler, build_optimizer, build_param_groups
from dflash_train.train.profiling import StepProfiler
from dflash_train.train.step import GradientStep, apply_gradients, batch_seed, micro_step
from dflash_train.train.stopping import RecentRate, StopControl, WeightAndStop, fitted_total, refit_due, schedule_fit
from dflash_train.train.timing import StageTimer
from dflash_train.utils.config import to_dict
from dflash_train.utils.device import resolve_device
from dflash_train.utils.errors import OutputError, TrainingError
from dflash_train.utils.fs import check_writable_dir
from dflash_train.utils.log import set_main_process
from dflash_train.utils.signals import StopSignals

log = logging.getLogger(__name__)


RESOLVED_KEY = "drafter_resolved"  # in the config.yaml a run writes, never in a config a user writes


def check_run_files(output_dir: Path) -> None:
    """Before a run writes into `output_dir`: a metrics.jsonl there must hold only metrics
    (read_records names a bad line), and a config.yaml there must be one a run wrote (it has
    RESOLVED_KEY, which a config a person writes does not have): a user's own config is never replaced."""
    if (output_dir / "metrics.jsonl").is_file():
        read_records(output_dir / "metrics.jsonl")
    config = output_dir / "config.yaml"
    if not config.exists():
        return
    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        data = None
    if not isinstance(data, dict) or RESOLVED_KEY not in data:
        raise OutputError(f"{config} is not a config a run wrote (a run writes its resolved config there, and this "
                          f"one would be replaced): choose another run.output_dir, or move the file")


def _saved_config(checkpoint: Path) -> dict:
    """The resolved config a checkpoint recorded ({} when it cannot be read)."""
    try:
        saved = yaml.safe_load((checkpoint / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    return saved if isinstance(saved, dict) else {}


def keep_edited_config(output_dir: Path, checkpoint: Path, new: dict) -> tuple[Path, list[str]] | None:
    """Before a resumed run writes its config.yaml (`new`): when the run folder's config.yaml holds values
    the checkpoint did not record and `new` does not carry (edited by hand: a run reads its config from
    --config and the options only), move it aside to config.yaml.edited (-2, -3, ...); returns where, and
    the edited keys lost otherwise. None when nothing would be lost."""
    path = output_dir / "config.yaml"
    if not path.is_file() or not (checkpoint / "config.yaml").is_file():
        return None
    try:
        ours = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError):
        ours = None
    flat_saved, flat_new = setup.flatten(_saved_config(checkpoint)), setup.flatten(to_dict(new))
    flat_ours = setup.flatten(ours) if isinstance(ours, dict) else {"(not a YAML mapping)": ours}
    edited = [k for k, v in flat_ours.items() if k not in flat_saved or flat_saved[k] != v]
    lost = sorted(k for k in edited if k not in flat_new or flat_new[k] != flat_ours[k])
    if not lost:
        return None
    kept, k = output_dir / "config.yaml.edited", 1
    while kept.exists():
        k += 1
        kept = output_dir / f"config.yaml.edited-{k}"
    path.rename(kept)
    return kept, lost


@dataclass
class StepOutcome:
    """What one `train_step` did."""

    micro: list[StepStats]  # the micro-batches' stats
    tokens: int
    exhausted: bool  # the data ran out during the step
    shared: WeightAndStop | None  # the step's all-reduce (None: no micro-batch was left)
    grad: GradientStep | None  # None: nothing applied (no micro-batch left, or a redo)


class Trainer:
    def __init__(self, cfg: TrainConfig, *, resume: bool | str = False, ctx: DistContext | None = None,
                 signals: StopSignals | None = None):
        self.cfg, self.signals = cfg, signals
        self.ctx = ctx = ctx or DistContext(layout="single", device=resolve_device(cfg.run.device))
        if not ctx.is_drafter:
            raise TrainingError(f"rank {ctx.rank} runs no drafter")
        self.main = ctx.is_main_drafter
        set_main_process(self.main)
        self.device = ctx.device
        self.output_dir = Path(cfg.run.output_dir)
        self.ckpt_dir = self.output_dir / "checkpoints"
        resume_from = checkpoint_to_resume(self.ckpt_dir, resume)

        # ---- cheap checks first: nothing heavy is loaded until the config is known to fit
        target_config, self.tokenizer = open_target(cfg.target.path, trust_remote_code=cfg.target.trust_remote_code)
        self.cfg = cfg = self._resolve_fast_path(cfg, target_config, resume_from)
        self.drafter_config = setup.resolve_drafter_config(cfg, target_config, self.tokenizer)
        self._check_inputs(resume_from)
        # drafter.init_from_target: checked on every start, applied on a fresh one only (a resume's checkpoint wins)
        self.init_layers = setup.resolve_init_layers(cfg, target_config)
        setup.check_target_options(cfg, target_config)  # attention, packed forward: before the target loads
        if self.main:  # the resolved config and the metrics go there even without checkpoints
            check_writable_dir(self.output_dir)
            check_run_files(self.output_dir)
        identity = tokenizer_identity(self.tokenizer) if self.tokenizer is not None else None
        self.data = open_data(cfg.data, seed=cfg.run.seed, vocab_size=self.drafter_config.vocab_size,
                              tokenizer_identity=identity)
        self.data_identity = setup.data_position_identity(cfg, self.data)
        self._check_data_position(resume_from)
        attention = setup.resolve_attention(cfg.step.attention, self.device, self.drafter_config.head_dim)
        self.step_cfg = StepConfig(num_anchors=cfg.step.num_anchors, label_source=cfg.step.label_source,
                                   noise_sigma=cfg.step.noise_sigma, attention=attention, fixed_shape=cfg.run.compile)
        self.padding = setup.compile_padding(cfg)
        self.total_steps = setup.total_optimizer_steps(cfg.run, cfg.optim.grad_accum, self.data.planner,
                                                       ctx.num_drafters)
        self.most_steps = self.total_steps  # the most the run does: run.fit_schedule fits (and refits) up to it
        self.total_batches = None if cfg.run.max_steps else self.total_steps * cfg.optim.grad_accum
        log.info("%s", self.data.planner.describe(0, world=ctx.num_drafters))
        if self.main:
            setup.announce_start(cfg, self.data.planner, self.device)
        d = self.drafter_config
        log.info("target %s | drafter %d layers, block %d, taps %s, mask token %d | %d steps on %s", cfg.target.path,
                 d.num_hidden_layers, d.block_size, d.target_layer_ids, d.mask_token_id, self.total_steps, self.device)

        # ---- heavy work
        torch.manual_seed(cfg.run.seed)
        self.target = setup.load_frozen_target(cfg, d, self.device, whole_model=ctx.is_target,
                                               group=ctx.target_group)
        self.drafter = setup.build_drafter(cfg, d, self.target.heads, self.device,
                                           init_layers=self.init_layers if resume_from is None else None,
                                           # a sharded target's layers are read from its files
                                           target_model=None if self.target.sharded else self.target.model)
        self.model = setup.wrap_drafter(self.drafter, ctx, compile=cfg.run.compile,
                                        autotune=cfg.run.compile_autotune)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(build_param_groups(self.drafter, cfg.optim), cfg.optim,
                                         compiled=cfg.run.compile and cfg.optim.compiled_step)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, lambda: self.total_steps)
        self.state = TrainState()
        if resume_from is not None:
            self.state = load_checkpoint(resume_from, drafter=self.drafter, optimizer=self.optimizer,
                                         scheduler=self.scheduler)
            log.info("resumed from %s (step %d, data cursor epoch %d batch %d)", resume_from, self.state.step,
                     self.state.epoch, self.state.index)
            if self.init_layers:
                log.info("drafter.init_from_target=%s not applied: the run continues from its checkpoint's weights",
                         cfg.drafter.init_from_target)
            if self.state.fitted_total:  # run.fit_schedule fitted it before: the schedule continues as fitted
                self.total_steps = min(self.total_steps, self.state.fitted_total)
        self.rate, self.fitted_here = RecentRate(), False
        self.remaining_batches = (self.total_steps - self.state.step) * cfg.optim.grad_accum
        if ctx.layout == "split":
            broadcast_start(ctx, epoch=self.state.epoch, index=self.state.index, batches=self.remaining_batches)
        self.resolved = {**to_dict(cfg), RESOLVED_KEY: {"target_layer_ids": d.target_layer_ids,
                                                              "mask_token_id": d.mask_token_id,
                                                              "init_from_target_layers": self.init_layers},
                         "data_resolved": {k.split(".", 1)[1]: v for k, v in self.data_identity.items()
                                           if k.startswith("data_resolved.")}}
        if self.main:
            edited = keep_edited_config(self.output_dir, resume_from, self.resolved) if resume_from else None
            if edited is not None:
                log.warning("%s/config.yaml was edited (%s) and this run does not take those values: a run reads "
                            "its config from --config and the options, not from its folder; the edited file is "
                            "kept as %s", self.output_dir, ", ".join(edited[1][:4]) + (" ..." if len(edited[1]) > 4
                                                                                        else ""), edited[0].name)
            (self.output_dir / "config.yaml").write_text(yaml.safe_dump(self.resolved, sort_keys=False))
        self.bad_in_a_row = 0
        self.consumed = ConsumedSamples()
        self.last_eval: tuple[int, dict] = (-1, {})
        self.evaluator = Evaluator(cfg, self.data, self.target, self.tokenizer, self.step_cfg, self.device,
                                   padding=self.padding, num_drafters=ctx.num_drafters)

    def _check_inputs(self, resume_from: Path | None) -> None:
        """The saved drafters this run starts from fit its config, and the held-out prompt file reads:
        found before the target loads, not after training."""
        cfg = self.cfg
        if resume_from is not None and (diff := setup.config_diff(load_drafter_config(resume_from / "drafter"),
                                                                  self.drafter_config)):
            raise TrainingError(f"{resume_from}: the checkpoint's drafter config differs from this run's ({diff}); "
                                f"resume with the config the run was started with, or start a new run.output_dir")
        saved = load_drafter_config(cfg.drafter.init_from) if cfg.drafter.init_from else None
        added = growth(saved, self.drafter_config) if saved is not None else []
        if added:
            log.info("drafter.init_from %s: this run's drafter adds %s; it drafts as the saved one did until "
                     "trained", cfg.drafter.init_from, " and ".join(added))
        elif added is None:
            raise TrainingError(f"drafter.init_from {cfg.drafter.init_from}: that drafter does not fit this run's "
                                f"config ({setup.config_diff(saved, self.drafter_config)}); set the drafter.* "
                                f"options to match it (a run may also add layers after its last, "
                                f"drafter.num_layers, or to a DFlash drafter the dspark head, drafter.variant)")
        if cfg.eval.spec_prompts not in (None, "", "heldout"):
            load_prompts(cfg.eval.spec_prompts, cfg.eval.spec_num_prompts or None)

    def _resolve_fast_path(self, cfg: TrainConfig, target_config, resume_from: Path | None) -> TrainConfig:
        """The `auto` settings decided (setup.resolve_fast_path), said in one line; on --resume, one line
        more for each that differs from what the checkpoint ran with (the run goes on either way)."""
        resolved, line = setup.resolve_fast_path(cfg, target_config, self.device)
        if line and self.main:
            log.info("%s", line)
        saved = _saved_config(resume_from) if resume_from is not None else {}
        for key in setup.FAST_PATH_FIELDS:
            section, name = key.split(".")
            before, now = (saved.get(section) or {}).get(name), getattr(getattr(resolved, section), name)
            if before not in (None, "auto") and before != now and self.main:
                log.warning("--resume: %s is %s now, the checkpoint ran with %s (set --%s %s to continue as it "
                            "ran)", key, str(now).lower(), str(before).lower(), key, str(before).lower())
        return resolved

    def _check_data_position(self, resume_from: Path | None) -> None:
        """--resume continues at the checkpoint's (epoch, batch): with other data options, seed or dataset
        that position names other batches, so it is refused (or, with run.resume_with_other_data, said)."""
        if resume_from is None:
            return
        changes = setup.data_position_changes(_saved_config(resume_from), self.data_identity)
        if not changes:
            return
        what = "; ".join(changes)
        if not self.cfg.run.resume_with_other_data:
            raise TrainingError(f"--resume: the data differ from {resume_from}'s ({what}): its data position would "
                                f"point at other batches; resume with the checkpoint's values, start a new "
                                f"run.output_dir, or pass --run.resume_with_other_data to continue anyway")
        log.warning("--resume with other data (%s): continuing from the checkpoint's data position "
                    "(run.resume_with_other_data)", what)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        cfg, state, D = self.cfg, self.state, self.ctx.num_drafters
        timer = StageTimer(self.device)
        metrics = MetricsLogger(self.output_dir, total_steps=self.total_steps, start_step=state.step,
                                tensorboard=cfg.run.tensorboard, progress=cfg.run.progress and self.main,
                                enabled=self.main)
        metrics.truncate_after(state.step)
        source = setup.build_batch_source(cfg, self.ctx, self.data, self.target, self.drafter_config,
                                          start=(state.epoch, state.index), budget=self.remaining_batches)
        window, last, exhausted, windows = Window(), {}, False, 0
        profiler = StepProfiler(cfg.run.profile_steps, self.output_dir, self.device, enabled=self.main)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        with StopControl(cfg.run, self.ctx, elapsed_before_s=state.elapsed_s, signals=self.signals) as control:
            try:
                while state.step < self.total_steps and not exhausted:
                    profiler.step_begins(state.step + 1)
                    done = self.train_step(source, timer, control)
                    exhausted = done.exhausted
                    if done.grad is None:  # no batch left, or a redo
                        break
                    if not done.grad.applied:
                        self._skip_nonfinite(metrics)
                        continue
                    self.bad_in_a_row = 0
                    state.step += 1
                    state.tokens += done.tokens
                    window.add(done.micro, done.tokens)
                    profiler.step_ended(state.step)
                    if windows == 0 and window.steps == 1:  # the compiles are behind us: say so, and the memory held
                        metrics.line(first_step_line(control.session_elapsed_s(), self.device))
                    metrics.progress(state.step, {"tok/s": window.tok_per_s(D), **{k: last[k] for k in ("loss", "tau")
                                                                                    if k in last}})
                    if state.step % cfg.run.log_every == 0 or state.step == self.total_steps:
                        last = self._log_window(metrics, window, timer, float(done.grad.grad_norm))
                        windows += 1
                        if windows == 1:  # the first window holds the compiles: the rate counts from its end
                            self.rate.start(state.step, control.session_elapsed_s())
                        else:
                            self._check_schedule(metrics, control, first=windows == 2)
                        window = Window()
                    if cfg.run.eval_every and state.step % cfg.run.eval_every == 0:
                        self.evaluate(metrics)
                    state.elapsed_s = control.elapsed_s()
                    if done.shared.stop:
                        break
                    if state.step % cfg.run.save_every == 0 or done.shared.save_due:
                        self.save(control, metrics)
            finally:
                profiler.close(state.step)
                source.close()
            state.elapsed_s = control.elapsed_s()
            path = self.save(control, metrics)
        return self._finish(metrics, control.reason, path, last, source.stats())

    def train_step(self, source, timer: StageTimer, control: StopControl) -> StepOutcome:
        """One optimizer step: accumulate the micro-batches' gradients, agree with the other
        replicas on the global loss weight and on stopping, apply the normalised gradients."""
        state = self.state
        cursor = (state.epoch, state.index, state.batches)
        micro, tokens, redo, exhausted = self._accumulate(source, timer)
        if not micro:
            return StepOutcome(micro, tokens, exhausted, None, None)
        t = timer.start()
        shared = control.all_reduce_weight_and_stop(torch.stack([s.weight_sum for s in micro]).sum(),
                                                    torch.stack([s.loss_sum for s in micro]).sum(),
                                                    stop_requested=source.stop_requested, redo=redo)
        if shared.redo:  # placeholders from a stopping target: redo these batches after resume
            self.optimizer.zero_grad(set_to_none=True)
            state.epoch, state.index, state.batches = cursor
            return StepOutcome(micro, tokens, exhausted, shared, None)
        with record_function("optimizer"):
            grad = apply_gradients(self.params, self.optimizer, self.scheduler, global_weight=shared.weight,
                                   global_loss=shared.loss, num_replicas=self.ctx.num_drafters,
                                   grad_clip=self.cfg.optim.grad_clip)
        timer.stop("optimizer", t)
        return StepOutcome(micro, tokens, exhausted, shared, grad)

    def _accumulate(self, source, timer: StageTimer) -> tuple[list[StepStats], int, bool, bool]:
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

    def _check_schedule(self, metrics: MetricsLogger, control: StopControl, *, first: bool) -> None:
        """Against the time box, from the second log window on: fit the schedule to it (run.fit_schedule)
        and refit it when the recent rate moves the fit (a load spike that passed, or began);
        without fit_schedule, or resumed from a fitted run, say once when it does not fit."""
        run, state = self.cfg.run, self.state
        elapsed = control.session_elapsed_s()
        self.rate.window_ended(state.step, elapsed)
        steps_per_s = self.rate.steps_per_s()
        box = dict(step=state.step, total=self.most_steps, steps_per_s=steps_per_s, session_elapsed_s=elapsed,
                   max_minutes=run.max_minutes)
        if not (run.fit_schedule and run.max_minutes) or (state.fitted_total and not self.fitted_here):
            if first:
                metrics.line(schedule_fit(**{**box, "total": self.total_steps}) or "")
            return
        fitted = torch.tensor(fitted_total(**box), device=self.device)
        if self.ctx.num_drafters > 1:  # the replicas must end at one step: the slowest one's count
            dist.all_reduce(fitted, op=dist.ReduceOp.MIN, group=self.ctx.drafters)
        fitted = int(fitted)  # agreed: every replica takes the same decision below
        if self.fitted_here and not refit_due(step=state.step, current_total=self.total_steps, fitted=fitted):
            return
        verb = "refitted" if self.fitted_here else "fitted"
        metrics.line(f"schedule {verb} to run.max_minutes={run.max_minutes:g}: {fitted:,} steps (the most is "
                     f"{self.most_steps:,}) at the measured {steps_per_s:.2f} steps/s")
        self.total_steps = state.fitted_total = fitted
        self.fitted_here = True
        metrics.set_total(self.total_steps)

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

    def _log_window(self, metrics: MetricsLogger, window: Window, timer: StageTimer, grad_norm: float) -> dict:
        m, split = window.metrics(timer, group=self.ctx.drafters, num_drafters=self.ctx.num_drafters,
                                  lr=self.scheduler.get_last_lr()[0], grad_norm=grad_norm, device=self.device)
        metrics.record(self.state.step, {**m, **{f"time_{k}_s": v for k, v in split.items()}})
        busy = sum(split.values()) or 1.0
        metrics.line(format_train_line(self.state.step, self.total_steps,
                                       {**m, "split": {k: split.get(k, 0.0) / busy for k in STAGES}},
                                       self.drafter_config.block_size))
        return m

    # ------------------------------------------------------------------ saving and measuring
    def save(self, control: StopControl, metrics: MetricsLogger) -> Path | None:
        """Checkpoint (the main drafter writes; data-parallel replicas hold the same weights)."""
        control.saved()
        if not self.main or not self.cfg.run.checkpoint:
            return None
        saved = self.ckpt_dir / step_dir_name(self.state.step)
        if saved.is_dir() and not verify_checkpoint(saved):
            return saved  # this step is saved already (the last step was a save_every step)
        path = save_checkpoint(self.ckpt_dir, drafter=self.drafter, optimizer=self.optimizer, scheduler=self.scheduler,
                               state=self.state, config=self.resolved, keep_last=self.cfg.run.keep_last)
        metrics.line(f"saved {path}")
        return path

    def evaluate(self, metrics: MetricsLogger | None = None) -> dict:
        """Estimate and held-out measurement of tau (main drafter with a target only)."""
        if self.target.runner is None or self.target.sharded or not self.main:
            return {}  # (a sharded target runs only with its whole group, as a split layout's drafters have none)
        if self.last_eval[0] != self.state.step:  # the end of a run right after an eval_every step: once
            self.last_eval = (self.state.step, self.evaluator(self.drafter, self.state.step, metrics))
        return self.last_eval[1]

    def _finish(self, metrics: MetricsLogger, interrupted_by: str | None, path: Path | None, last: dict,
                transport: dict) -> dict:
        state, D = self.state, self.ctx.num_drafters
        # `last` (the last log window's metrics) carries its own tok_per_s: kept apart from the
        # run's average, which the summary line prints beside the run's tokens and seconds
        summary = {**last, "last_window_tok_per_s": last.get("tok_per_s"),
                   "steps": state.step, "tokens": state.tokens * D, "elapsed_s": state.elapsed_s,
                   "tok_per_s": state.tokens * D / max(state.elapsed_s, 1e-9), "checkpoint": str(path),
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
