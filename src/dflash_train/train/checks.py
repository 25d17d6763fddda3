"""The first phase of a training run: every check that needs no model weights, cheapest first.

`check_run` reads the target's config and tokenizer, decides the `auto` settings, builds the
drafter config, and checks the run against the checkpoint it resumes from (or the drafter it
starts from), the target's options, the run folder and the data, so that a run that cannot go
on fails in seconds, before the target loads (the second phase, train/trainer.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from dflash_train.data.prompts import load_prompts
from dflash_train.data.splits import DataSplits, open_data
from dflash_train.drafter.checkpoint import growth, load_drafter_config
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.step import StepConfig
from dflash_train.pipeline.context import DistContext
from dflash_train.target.loading import open_target, tokenizer_identity
from dflash_train.train import setup
from dflash_train.train.checkpoint import checkpoint_to_resume
from dflash_train.train.config import TrainConfig
from dflash_train.train.run_files import check_run_files, saved_config
from dflash_train.utils.errors import TrainingError
from dflash_train.utils.fs import check_writable_dir

log = logging.getLogger(__name__)


@dataclass
class CheckedRun:
    """A run as its checks leave it: what the build phase needs, nothing loaded yet."""

    cfg: TrainConfig  # the `auto` settings decided
    tokenizer: object | None
    drafter_config: DrafterConfig
    init_layers: list[int] | None  # drafter.init_from_target's source layers (applied on a fresh start only)
    data: DataSplits
    data_identity: dict  # what gives a data position its meaning (setup.data_position_identity)
    step_cfg: StepConfig  # the `step` section as this run's steps run it
    most_steps: int  # the most optimizer steps the run does (run.max_steps, or the epochs' steps)
    resume_from: Path | None  # the checkpoint the run continues from


def check_run(cfg: TrainConfig, ctx: DistContext, resume: bool | str) -> CheckedRun:
    """Everything about the run that can be checked before the target loads (see the module's
    docstring); the main drafter rank speaks for the run (its logs, its folder)."""
    main = ctx.is_main_drafter
    output_dir = Path(cfg.run.output_dir)
    resume_from = checkpoint_to_resume(output_dir / "checkpoints", resume)
    target_config, tokenizer = open_target(cfg.target.path, trust_remote_code=cfg.target.trust_remote_code)
    cfg = resolve_fast_path(cfg, target_config, ctx, resume_from, main=main)
    drafter_config = setup.resolve_drafter_config(cfg, target_config, tokenizer)
    check_inputs(cfg, drafter_config, resume_from)
    # drafter.init_from_target: checked on every start, applied on a fresh one only (a resume's checkpoint wins)
    init_layers = setup.resolve_init_layers(cfg, target_config)
    setup.check_target_options(cfg, target_config)  # attention, packed forward: before the target loads
    if main:  # the resolved config and the metrics go there even without checkpoints
        check_writable_dir(output_dir)
        check_run_files(output_dir)
    identity = tokenizer_identity(tokenizer) if tokenizer is not None else None
    data = open_data(cfg.data, seed=cfg.run.seed, vocab_size=drafter_config.vocab_size, tokenizer_identity=identity)
    data_identity = setup.data_position_identity(cfg, data)
    check_data_position(cfg, data_identity, resume_from)
    step_cfg = setup.resolve_step(cfg, ctx.device, drafter_config.head_dim)
    most_steps = setup.total_optimizer_steps(cfg.run, cfg.optim.grad_accum, data.planner, ctx.num_drafters)
    return CheckedRun(cfg, tokenizer, drafter_config, init_layers, data, data_identity, step_cfg, most_steps,
                      resume_from)


def resolve_fast_path(cfg: TrainConfig, target_config, ctx: DistContext, resume_from: Path | None, *,
                      main: bool) -> TrainConfig:
    """The `auto` settings decided (setup.resolve_fast_path), said in one line; on --resume, one line
    more for each that differs from what the checkpoint ran with (the run goes on either way)."""
    resolved, line = setup.resolve_fast_path(cfg, target_config, ctx.device)
    if line and main:
        log.info("%s", line)
    saved = setup.flatten(saved_config(resume_from)) if resume_from is not None else {}
    for key in setup.FAST_PATH_FIELDS:
        before, now = saved.get(key), setup.config_value(resolved, key)
        if before not in (None, "auto") and before != now and main:
            log.warning("--resume: %s is %s now, the checkpoint ran with %s (set --%s %s to continue as it "
                        "ran)", key, str(now).lower(), str(before).lower(), key, str(before).lower())
    return resolved


def check_inputs(cfg: TrainConfig, drafter_config: DrafterConfig, resume_from: Path | None) -> None:
    """The saved drafters this run starts from fit its config, and the held-out prompt file reads:
    found before the target loads, not after training."""
    if resume_from is not None and (diff := setup.config_diff(load_drafter_config(resume_from / "drafter"),
                                                              drafter_config)):
        raise TrainingError(f"{resume_from}: the checkpoint's drafter config differs from this run's ({diff}); "
                            f"resume with the config the run was started with, or start a new run.output_dir")
    saved = load_drafter_config(cfg.drafter.init_from) if cfg.drafter.init_from else None
    added = growth(saved, drafter_config) if saved is not None else []
    if added:
        log.info("drafter.init_from %s: this run's drafter adds %s; it drafts as the saved one did until "
                 "trained", cfg.drafter.init_from, " and ".join(added))
    elif added is None:
        raise TrainingError(f"drafter.init_from {cfg.drafter.init_from}: that drafter does not fit this run's "
                            f"config ({setup.config_diff(saved, drafter_config)}); set the drafter.* "
                            f"options to match it (a run may also add layers after its last, "
                            f"drafter.num_layers, or to a DFlash drafter the dspark head, drafter.variant)")
    if cfg.eval.spec_prompts not in (None, "", "heldout"):
        load_prompts(cfg.eval.spec_prompts, cfg.eval.spec_num_prompts or None)


def check_data_position(cfg: TrainConfig, data_identity: dict, resume_from: Path | None) -> None:
    """--resume continues at the checkpoint's (epoch, batch): with other data options, seed or dataset
    that position names other batches, so it is refused (or, with run.resume_with_other_data, said)."""
    if resume_from is None:
        return
    changes = setup.data_position_changes(saved_config(resume_from), data_identity)
    if not changes:
        return
    what = "; ".join(changes)
    if not cfg.run.resume_with_other_data:
        raise TrainingError(f"--resume: the data differ from {resume_from}'s ({what}): its data position would "
                            f"point at other batches; resume with the checkpoint's values, start a new "
                            f"run.output_dir, or pass --run.resume_with_other_data to continue anyway")
    log.warning("--resume with other data (%s): continuing from the checkpoint's data position "
                "(run.resume_with_other_data)", what)
