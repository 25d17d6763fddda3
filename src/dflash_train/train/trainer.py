"""Single-process training: target and drafter on one device.

One optimizer step, for each of `grad_accum` micro-batches:

    batch (CPU, read ahead)  --to device-->  target taps (frozen, no grad)
        --> drafter_step: anchors, labels, mask, forward, loss sums  --> backward
then gradients are divided by the weight sum of all micro-batches (the spec's global
normalisation), clipped, and applied. Everything a resumed run needs is checkpointed;
see train/checkpoint.py.
"""

from __future__ import annotations

import contextlib
import math
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from dflash_train.data.batch import PackedBatch
from dflash_train.data.batching import BatchPlanner
from dflash_train.data.dataset import TokenDataset
from dflash_train.drafter.checkpoint import load_drafter, save_drafter
from dflash_train.drafter.config import DrafterConfig, drafter_config_from_target
from dflash_train.drafter.loss import StepStats, summarize
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.drafter.step import FrozenHeads, StepConfig, drafter_step
from dflash_train.pipeline.context import DistContext
from dflash_train.pipeline.sources import LocalTargetSource, RemoteTargetSource, reduce_stats
from dflash_train.data.synthetic import SyntheticDataset, is_synthetic
from dflash_train.target.loading import (
    choose_mask_token_id,
    load_target_heads,
    load_target_model,
    open_target,
    tokenizer_identity,
)
from dflash_train.target.runner import TargetOutput, TargetRunner, unpack_documents
from dflash_train.train.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
from dflash_train.train.config import TrainConfig
from dflash_train.train.loader import PrefetchLoader
from dflash_train.train.metrics_log import MetricsLogger, format_train_line
from dflash_train.train.schedule import warmup_cosine
from dflash_train.train.timing import StageTimer
from dflash_train.utils.config import to_dict

STAGES = ("data", "queue_wait", "target", "forward", "backward", "optimizer")


class TrainingError(RuntimeError):
    """A run that cannot start or continue; the message says why and what to change."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise TrainingError(f"run.device={name} but no CUDA device is available")
    return device


def batch_seed(seed: int, epoch: int, index: int, stream: int = 0) -> int:
    """Seed of the anchor/noise generator for one batch: the same batch always draws the
    same anchors in the same run, whichever process trains it or after a resume.
    `stream` separates training (0) from evaluation (1) draws."""
    return int(np.random.SeedSequence([seed, stream, epoch, index]).generate_state(1, dtype=np.uint64)[0] >> 1)


class ConsumedSamples:
    """Which samples this drafter trained on, as count/sum/sum of squares of the dataset ids:
    enough to check 'every sample exactly once' across ranks without listing millions."""

    def __init__(self):
        self.count = self.total = self.squares = 0

    def add(self, batch: PackedBatch) -> None:
        ids = batch.sample_ids.tolist()
        self.count += len(ids)
        self.total += sum(ids)
        self.squares += sum(i * i for i in ids)

    def as_dict(self) -> dict:
        return {"samples": self.count, "sample_id_sum": self.total, "sample_id_sq_sum": self.squares}


class IndexSubset:
    """A view of some samples of a dataset (train/eval split) with the Dataset interface."""

    def __init__(self, dataset, indices: np.ndarray):
        self.dataset, self.indices = dataset, np.asarray(indices, dtype=np.int64)
        self.lengths = np.asarray(dataset.lengths)[self.indices]

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.dataset[int(self.indices[i])]


@dataclass
class DataSplits:
    train: object
    eval: object | None
    planner: BatchPlanner
    eval_planner: BatchPlanner | None


def open_data(cfg: TrainConfig, tokenizer, vocab_size: int) -> DataSplits:
    """Open and check the datasets, split off eval, plan batches. No model is loaded yet."""
    if is_synthetic(cfg.data.path):
        try:
            dataset = SyntheticDataset(cfg.data.path, vocab_size=vocab_size, seed=cfg.run.seed)
        except ValueError as exc:
            raise TrainingError(str(exc)) from None
    else:
        try:
            dataset = TokenDataset(cfg.data.path)
        except FileNotFoundError as exc:
            raise TrainingError(str(exc)) from None
    if len(dataset) == 0:
        raise TrainingError(f"{cfg.data.path}: the dataset is empty (0 samples): check the prepare manifest")
    if tokenizer is not None and not is_synthetic(cfg.data.path):
        try:
            dataset.check_tokenizer(tokenizer_identity(tokenizer))
        except ValueError as exc:
            raise TrainingError(f"{cfg.data.path} was tokenized with a different tokenizer than the target "
                                f"{cfg.target.path}: {exc}") from None
    eval_set = None
    train_set = dataset
    if cfg.data.eval_path:
        eval_set = TokenDataset(cfg.data.eval_path)
        if tokenizer is not None:
            eval_set.check_tokenizer(tokenizer_identity(tokenizer))
    elif cfg.data.eval_fraction > 0:
        order = np.random.default_rng([cfg.run.seed, 7]).permutation(len(dataset))
        k = max(1, int(round(cfg.data.eval_fraction * len(dataset))))
        if k >= len(dataset):
            raise TrainingError("data.eval_fraction leaves no training samples")
        eval_set, train_set = IndexSubset(dataset, np.sort(order[:k])), IndexSubset(dataset, np.sort(order[k:]))
    try:
        planner = BatchPlanner(train_set.lengths, cfg.data.plan)
        eval_planner = None
        if eval_set is not None:
            eval_cfg = type(cfg.data.plan)(**{**cfg.data.plan.__dict__, "shuffle": False})
            eval_planner = BatchPlanner(eval_set.lengths, eval_cfg)
    except ValueError as exc:
        raise TrainingError(f"{cfg.data.path}: {exc}") from None
    return DataSplits(train_set, eval_set, planner, eval_planner)


def build_drafter_config(cfg: TrainConfig, target_config, tokenizer) -> DrafterConfig:
    text_cfg = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    spec = cfg.drafter
    mask_id = spec.mask_token_id
    if mask_id is None:
        mask_id = (choose_mask_token_id(tokenizer, int(text_cfg.vocab_size)) if tokenizer is not None
                   else int(text_cfg.vocab_size) - 1)
    try:
        return drafter_config_from_target(
            text_cfg,
            mask_token_id=mask_id,
            num_hidden_layers=spec.num_layers,
            block_size=spec.block_size,
            num_taps=spec.num_taps,
            target_layer_ids=spec.target_layer_ids,
            layer_types=spec.layer_types,
            sliding_window=spec.sliding_window,
            intermediate_size=spec.intermediate_size,
            causal_in_block_full=spec.causal_in_block_full,
            causal_in_block_sliding=spec.causal_in_block_sliding,
        )
    except ValueError as exc:
        raise TrainingError(f"drafter config does not fit the target {cfg.target.path}: {exc}") from None


def target_dtype(name: str, device: torch.device) -> torch.dtype:
    return {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16, "float32": torch.float32}[name]


def total_optimizer_steps(cfg: TrainConfig, planner: BatchPlanner, num_drafters: int) -> int:
    """Optimizer steps of the run: run.max_steps, or run.epochs over each drafter's share."""
    if cfg.run.max_steps:
        return cfg.run.max_steps
    per_drafter = planner.batches_per_epoch(num_drafters)
    return max(1, int(math.ceil(cfg.run.epochs * max(1, per_drafter // cfg.optim.grad_accum))))


class Trainer:
    """The drafter side of training: single process, or one drafter rank of a pipeline."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, log=print, ctx: DistContext | None = None):
        self.cfg = cfg
        self.ctx = ctx or DistContext(layout="single", device=resolve_device(cfg.run.device))
        if not self.ctx.is_drafter:
            raise TrainingError(f"rank {self.ctx.rank} runs no drafter")
        self.main = self.ctx.is_main_drafter
        self.log = log if self.main else (lambda *_: None)
        log = self.log
        self.device = self.ctx.device
        self.output_dir = Path(cfg.run.output_dir)
        self.ckpt_dir = self.output_dir / "checkpoints"
        resume_from = latest_checkpoint(self.ckpt_dir) if resume else None
        if resume and resume_from is None:
            log(f"--resume: no complete checkpoint in {self.ckpt_dir}; starting from scratch")
        if not resume and latest_checkpoint(self.ckpt_dir) is not None:
            raise TrainingError(f"{self.ckpt_dir} already holds checkpoints: pass --resume to continue that run, "
                                f"or choose another run.output_dir")

        # ---- cheap checks first: nothing heavy is loaded until the config is known to fit
        try:
            target_config, self.tokenizer = open_target(cfg.target.path, trust_remote_code=cfg.target.trust_remote_code)
        except (FileNotFoundError, ValueError) as exc:
            raise TrainingError(str(exc)) from None
        self.drafter_config = build_drafter_config(cfg, target_config, self.tokenizer)
        self.data = open_data(cfg, self.tokenizer, self.drafter_config.vocab_size)
        self.step_cfg = StepConfig(
            num_anchors=cfg.step.num_anchors,
            label_source=cfg.step.label_source,
            noise_sigma=cfg.step.noise_sigma,
            attention=("flex" if self.device.type == "cuda" else "dense") if cfg.step.attention == "auto"
            else cfg.step.attention,
            fixed_shape=cfg.run.compile,
        )
        if self.step_cfg.attention == "flex" and self.device.type == "cpu":
            raise TrainingError("step.attention=flex needs a GPU: FlexAttention has no backward on CPU; use dense")
        self.total_steps = total_optimizer_steps(cfg, self.data.planner, self.ctx.num_drafters)
        log(self.data.planner.describe(0, world=self.ctx.num_drafters))
        log(f"target {cfg.target.path} | drafter {self.drafter_config.num_hidden_layers} layers, block "
            f"{self.drafter_config.block_size}, taps {self.drafter_config.target_layer_ids}, mask token "
            f"{self.drafter_config.mask_token_id} | {self.total_steps} steps on {self.device}")

        # ---- heavy work
        torch.manual_seed(cfg.run.seed)
        dtype = target_dtype(cfg.target.dtype, self.device)
        t0 = time.perf_counter()
        self.runner = None
        if self.ctx.is_target:  # single / colocated: the target runs in this process
            self.target = load_target_model(cfg.target.path, dtype=dtype, device=self.device,
                                            trust_remote_code=cfg.target.trust_remote_code,
                                            attn_implementation=cfg.target.attn_implementation, fp8=cfg.target.fp8)
            self.runner = TargetRunner(self.target, self.drafter_config.target_layer_ids,
                                       need_final=cfg.step.label_source != "data")
            embed = self.target.get_input_embeddings().weight
            head = self.target.get_output_embeddings()
            self.heads = FrozenHeads(embed, head.weight if head is not None else embed)
        else:  # split drafter rank: only the embedding and LM head of the target
            self.heads = FrozenHeads(*load_target_heads(cfg.target.path, dtype=dtype, device=self.device,
                                                        trust_remote_code=cfg.target.trust_remote_code))
        log(f"loaded the target{'' if self.runner else ' embedding and LM head'} in {time.perf_counter() - t0:.1f}s")
        if cfg.drafter.init_from:
            self.drafter = load_drafter(cfg.drafter.init_from)
            if self.drafter.config != self.drafter_config:
                raise TrainingError(f"drafter.init_from {cfg.drafter.init_from}: its config differs from this run's")
        else:
            self.drafter = DFlashDrafter(self.drafter_config)
            # Start with near-uniform predictions: scale the output norm so that logits
            # through the target's LM head have unit standard deviation. With unit norm
            # weights a large-norm head (SmolLM2's) starts at a cross-entropy of ~37 nats.
            with torch.no_grad():
                head_rms = self.heads.lm_head_weight.float().pow(2).mean().sqrt()
                self.drafter.norm.weight.fill_(float(1.0 / (head_rms * self.drafter_config.hidden_size ** 0.5)))
        master = torch.float32 if cfg.run.drafter_dtype == "float32" else torch.bfloat16
        self.drafter.to(self.device, master).train()
        self.model_fn = self.drafter
        if self.ctx.num_drafters > 1:  # data-parallel drafters over their own process group
            import warnings

            from torch.nn.parallel import DistributedDataParallel

            # the drafter's only buffer (RoPE frequencies) is identical everywhere: no syncing
            warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
            self.model_fn = DistributedDataParallel(
                self.drafter, process_group=self.ctx.drafters, broadcast_buffers=False,
                device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if cfg.run.compile:
            self.model_fn = torch.compile(self.model_fn)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
            fused=self.device.type == "cuda",
        )
        self.scheduler = warmup_cosine(self.optimizer, warmup=o.warmup_steps, total=self.total_steps,
                                       min_ratio=o.min_lr_ratio)
        self.state = TrainState()
        if resume_from is not None:
            self.state = load_checkpoint(resume_from, drafter=self.drafter, optimizer=self.optimizer,
                                         scheduler=self.scheduler)
            log(f"resumed from {resume_from} (step {self.state.step}, data cursor "
                f"epoch {self.state.epoch} batch {self.state.index})")
        self.remaining_batches = (self.total_steps - self.state.step) * cfg.optim.grad_accum
        if self.ctx.layout == "split":
            from dflash_train.pipeline.target_worker import broadcast_start

            broadcast_start(self.ctx, epoch=self.state.epoch, index=self.state.index,
                            batches=self.remaining_batches)
        self.resolved = to_dict(cfg)
        self.resolved["drafter_resolved"] = {"target_layer_ids": self.drafter_config.target_layer_ids,
                                             "mask_token_id": self.drafter_config.mask_token_id}
        if self.main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            (self.output_dir / "config.yaml").write_text(yaml.safe_dump(self.resolved, sort_keys=False))
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda"
                         else contextlib.nullcontext())
        self.stop_signal: str | None = None
        self.bad_in_a_row = 0

    # ------------------------------------------------------------------ one micro-batch
    def global_index(self, batch: PackedBatch) -> int:
        """Batch `index` of drafter d's share is batch index * D + d of the global order."""
        return batch.index * self.ctx.num_drafters + (self.ctx.drafter_index if self.ctx.num_drafters > 1 else 0)

    def pad_for_compile(self, batch: PackedBatch) -> PackedBatch:
        if not self.cfg.run.compile:
            return batch
        plan = self.cfg.data.plan
        return batch.pad_to(plan.max_rows, int(plan.row_tokens))

    def micro_step(self, batch: PackedBatch, timer: StageTimer, *, target_out: TargetOutput | None = None,
                   step_cfg: StepConfig | None = None, train: bool = True, model=None) -> StepStats:
        step_cfg = step_cfg or self.step_cfg
        batch = self.pad_for_compile(batch)
        b = batch.to(self.device, non_blocking=True)
        gen = torch.Generator(device=self.device).manual_seed(
            batch_seed(self.cfg.run.seed, batch.epoch, self.global_index(batch), stream=0 if train else 1))
        if target_out is None:
            t = timer.start()
            flat, doc, pos, D, L = unpack_documents(batch.document_ids, batch.position_ids)  # on the CPU copy
            layout = (*(x.to(self.device, non_blocking=True) for x in (flat, doc, pos)), D, L)
            with torch.no_grad():
                target_out = self.runner(b.input_ids, b.position_ids, b.document_ids,
                                         need_final=step_cfg.label_source != "data", layout=layout)
            timer.stop("target", t)
        t = timer.start()
        with self.autocast:
            stats = drafter_step(
                model or self.model_fn, self.heads, input_ids=b.input_ids, position_ids=b.position_ids,
                document_ids=b.document_ids, loss_mask=b.loss_mask, taps=target_out.taps,
                final_hidden=target_out.final_hidden, step_cfg=step_cfg, loss_cfg=self.cfg.loss, generator=gen,
            )
        timer.stop("forward", t)
        if train:
            t = timer.start()
            stats.loss_sum.backward()
            timer.stop("backward", t)
        return stats.detached()

    # ------------------------------------------------------------------ the loop
    def _install_signals(self):
        previous = {}

        def handler(signum, frame):
            name = signal.Signals(signum).name
            if self.stop_signal is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: stop now, the last checkpoint stands
            self.stop_signal = name
            self.log(f"\n{name} received: finishing this step, saving a checkpoint, then exiting "
                     f"(Ctrl-C again to stop without saving)")

        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
        return previous

    def save(self) -> Path | None:
        """Checkpoint (the main drafter writes; data-parallel replicas hold the same weights)."""
        self.last_save_time = time.perf_counter()
        if not self.main or not self.cfg.run.checkpoint:
            return None
        return save_checkpoint(self.ckpt_dir, drafter=self.drafter, optimizer=self.optimizer, scheduler=self.scheduler,
                               state=self.state, config=self.resolved, keep_last=self.cfg.run.keep_last)

    def _batch_source(self):
        cfg, state, ctx = self.cfg, self.state, self.ctx
        epochs = None if cfg.run.max_steps else int(math.ceil(cfg.run.epochs))
        batches = self.data.planner.iter_batches(
            self.data.train, start=(state.epoch, state.index), epochs=epochs,
            rank=ctx.drafter_index if ctx.num_drafters > 1 else 0, world=ctx.num_drafters)
        loader = PrefetchLoader(batches, depth=max(cfg.data.prefetch, cfg.pipeline.queue_depth + 1),
                                pin_memory=self.device.type == "cuda")
        if self.runner is not None:
            return LocalTargetSource(loader)
        return RemoteTargetSource(
            loader, ctx, taps_width=self.drafter_config.num_taps * self.drafter_config.hidden_size,
            hidden=self.drafter_config.hidden_size, need_final=cfg.step.label_source != "data",
            dtype=target_dtype(cfg.target.dtype, self.device), queue_depth=cfg.pipeline.queue_depth,
            budget=self.remaining_batches, prepare=self.pad_for_compile)

    def _agree(self, weight: torch.Tensor, stop: bool, poisoned: bool) -> tuple[torch.Tensor, bool, bool]:
        """Global loss normaliser and the stop decision, the same on every drafter (one all-reduce)."""
        if self.ctx.num_drafters == 1:
            return weight, stop, poisoned
        import torch.distributed as dist

        flags = torch.stack([weight.float().reshape(()), torch.tensor(float(stop), device=weight.device),
                             torch.tensor(float(poisoned), device=weight.device)])
        dist.all_reduce(flags, group=self.ctx.drafters)
        return flags[0], bool(flags[1] > 0), bool(flags[2] > 0)

    def fit(self) -> dict:
        cfg, state, ctx = self.cfg, self.state, self.ctx
        timer = StageTimer(self.device)
        logger = MetricsLogger(self.output_dir, total_steps=self.total_steps, start_step=state.step,
                               tensorboard=cfg.run.tensorboard and self.main, progress=cfg.run.progress and self.main,
                               enabled=self.main)
        logger.truncate_after(state.step)
        source = self._batch_source()
        previous = self._install_signals() if _is_main_thread() else {}
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        ddp = self.ctx.num_drafters > 1
        D = self.ctx.num_drafters
        window: list[StepStats] = []
        window_tokens, window_start = 0, time.perf_counter()
        run_start, start_elapsed = time.perf_counter(), state.elapsed_s
        self.consumed = ConsumedSamples()
        self.last_save_time = time.perf_counter()
        last_metrics: dict = {}
        exhausted = False
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            while state.step < self.total_steps and not exhausted:
                micro: list[StepStats] = []
                tokens = 0
                poisoned = False
                step_cursor = (state.epoch, state.index)
                for k in range(cfg.optim.grad_accum):
                    t = time.perf_counter()
                    try:
                        batch, target_out, bad_batch = source.next(timer)
                    except StopIteration:
                        exhausted = True
                        break
                    timer.add_host("data", time.perf_counter() - t)
                    poisoned |= bad_batch
                    self.consumed.add(batch)
                    state.epoch, state.index = batch.epoch, batch.index + 1
                    tokens += batch.num_tokens
                    sync = ddp and k < cfg.optim.grad_accum - 1
                    with self.model_fn.no_sync() if sync and hasattr(self.model_fn, "no_sync") else contextlib.nullcontext():
                        micro.append(self.micro_step(batch, timer, target_out=target_out))
                if not micro:
                    break
                t = timer.start()
                out_of_time = bool(cfg.run.max_minutes) and \
                    (time.perf_counter() - run_start) / 60 >= cfg.run.max_minutes
                stop_here = self.stop_signal is not None or source.stop_requested or out_of_time
                weight, stop_here, poisoned = self._agree(torch.stack([s.weight_sum for s in micro]).sum(),
                                                          stop_here, poisoned)
                if poisoned:  # a target sent stop-request placeholders: redo these batches after resume
                    self.optimizer.zero_grad(set_to_none=True)
                    state.epoch, state.index = step_cursor
                    self.stop_signal = self.stop_signal or "stop request"
                    timer.stop("optimizer", t)
                    break
                # DDP averaged the replicas' gradients of the loss *sums*: times D / (global weight
                # sum) gives the gradient of the globally normalised loss.
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_((D / weight.clamp(min=1e-12)).to(p.grad.dtype))
                norm = (torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip) if cfg.optim.grad_clip > 0
                        else torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params if p.grad is not None])))
                loss_total = torch.stack([s.loss_sum for s in micro]).sum()
                finite = bool(torch.isfinite(norm) & torch.isfinite(loss_total))  # one sync per step
                if ddp:  # the same decision on every replica
                    finite = not self._agree(torch.zeros((), device=self.device), not finite, False)[1]
                if not finite:
                    self.optimizer.zero_grad(set_to_none=True)
                    self.bad_in_a_row += 1
                    state.bad_steps_total += 1
                    logger.line(f"step {state.step + 1}: non-finite loss or gradient, step skipped "
                                f"({self.bad_in_a_row} in a row, {state.bad_steps_total} in all)")
                    logger.record(state.step + 1, {"skipped_nonfinite": 1.0, "bad_in_a_row": float(self.bad_in_a_row)})
                    if self.bad_in_a_row >= cfg.run.max_bad_steps:
                        raise TrainingError(f"{self.bad_in_a_row} non-finite steps in a row (run.max_bad_steps="
                                            f"{cfg.run.max_bad_steps}): lower optim.lr or check the data")
                    timer.stop("optimizer", t)
                    continue
                self.bad_in_a_row = 0
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                timer.stop("optimizer", t)
                state.step += 1
                state.tokens += tokens
                window.extend(micro)
                window_tokens += tokens
                now = time.perf_counter()
                logger.progress(state.step, {"tok/s": window_tokens * D / max(now - window_start, 1e-9),
                                             **({"loss": last_metrics["loss"], "tau": last_metrics["tau"]}
                                                if last_metrics else {})})
                if state.step % cfg.run.log_every == 0 or state.step == self.total_steps:
                    last_metrics = self._log_window(logger, window, window_tokens, now - window_start, timer, norm)
                    window, window_tokens, window_start = [], 0, time.perf_counter()
                if (self.data.eval is not None and cfg.run.eval_every and state.step % cfg.run.eval_every == 0
                        and self.runner is not None and self.main):
                    self.evaluate(logger)
                state.elapsed_s = start_elapsed + time.perf_counter() - run_start
                due_minutes = (cfg.run.save_every_minutes and
                               (time.perf_counter() - self.last_save_time) / 60 >= cfg.run.save_every_minutes)
                if ddp and cfg.run.save_every_minutes:  # wall clocks differ: follow the main drafter
                    due_minutes = self._agree(torch.zeros((), device=self.device), bool(due_minutes and self.main), False)[1]
                if stop_here:
                    break
                if state.step % cfg.run.save_every == 0 or due_minutes:
                    path = self.save()
                    if path:
                        logger.line(f"saved {path}")
        finally:
            source.close()
            for sig, h in previous.items():
                signal.signal(sig, h)
        state.elapsed_s = start_elapsed + time.perf_counter() - run_start
        path = self.save()
        logger.line(f"saved {path}" if path else "")
        summary = {"steps": state.step, "tokens": state.tokens * D, "elapsed_s": state.elapsed_s,
                   "tok_per_s": state.tokens * D / max(state.elapsed_s, 1e-9), "checkpoint": str(path),
                   "interrupted_by": self.stop_signal, "bad_steps": state.bad_steps_total, **last_metrics,
                   "transport": source.stats(), "consumed": self.consumed.as_dict()}
        if self.stop_signal is None and state.step < self.total_steps:
            logger.line(f"stopped at step {state.step} of {self.total_steps}: run.max_minutes={cfg.run.max_minutes} "
                        f"reached or the data ran out")
        if self.stop_signal is None and self.main and cfg.run.checkpoint:
            final = save_drafter(self.drafter, self.output_dir / "final")
            summary["final_drafter"] = str(final)
            if self.data.eval is not None and self.runner is not None:
                summary["eval"] = self.evaluate(logger)
            if cfg.eval.spec_prompts:
                summary["spec_eval"] = self.speculative_eval(logger)
        logger.close()
        return summary

    def _log_window(self, logger, window, tokens, seconds, timer, norm) -> dict:
        D = self.ctx.num_drafters
        stats = reduce_stats(window, self.ctx.drafters) if D > 1 else window
        m = summarize(stats)
        split = timer.collect()
        busy = sum(split.values()) or 1.0
        m.update(lr=self.scheduler.get_last_lr()[0], tok_per_s=tokens * D / max(seconds, 1e-9), grad_norm=float(norm),
                 window_tokens=tokens * D, window_s=seconds)
        if self.device.type == "cuda":
            m["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        scalars = {k: v for k, v in m.items()}
        scalars.update({f"time_{k}_s": v for k, v in split.items()})
        logger.record(self.state.step, scalars)
        logger.line(format_train_line(self.state.step, self.total_steps,
                                      {**m, "split": {k: split.get(k, 0.0) / busy for k in STAGES}},
                                      self.drafter_config.block_size))
        return m

    @torch.no_grad()
    def evaluate(self, logger: MetricsLogger | None = None) -> dict:
        """Eval split with `target` labels: tau here estimates speculative-decoding acceptance."""
        if self.data.eval is None:
            return {}
        was_training = self.drafter.training
        self.drafter.eval()
        eval_cfg = StepConfig(**{**self.step_cfg.__dict__, "label_source": "target", "noise_sigma": 0.0})
        timer = StageTimer(self.device)
        stats = []
        for i, batch in enumerate(self.data.eval_planner.iter_batches(self.data.eval, start=(0, 0), epochs=1)):
            if self.cfg.data.eval_batches and i >= self.cfg.data.eval_batches:
                break
            stats.append(self.micro_step(batch, timer, step_cfg=eval_cfg, train=False, model=self.drafter))
        self.drafter.train(was_training)
        if not stats:
            return {}
        m = summarize(stats)
        if logger is not None:
            logger.record(self.state.step, m, kind="eval")
            logger.line(f"eval @ step {self.state.step}: tau {m['tau']:.3f} (target labels) | ce {m['ce']:.3f} | "
                        f"acc_1 {m.get('acc_1', float('nan')):.3f}")
        return m


    def speculative_eval(self, logger: MetricsLogger | None = None) -> dict:
        """tau measured by real speculative decoding (eval/) on held-out prompts."""
        from dflash_train.eval.prompts import load_prompts
        from dflash_train.eval.run import speculative_tau

        e = self.cfg.eval
        say = logger.line if logger is not None else self.log
        if self.runner is None or self.tokenizer is None:
            say("eval.spec_prompts: skipped, this process holds no target with a tokenizer "
                "(run `dflash-train eval` on the exported drafter instead)")
            return {}
        say(f"speculative decoding on {e.spec_num_prompts or 'all'} prompts of {e.spec_prompts} ...")
        prompts = load_prompts(e.spec_prompts, e.spec_num_prompts or None)
        # the runner's hooks end target forwards early: decoding needs plain forwards (end of run only)
        self.runner.close()
        self.runner = None
        m = speculative_tau(self.target, self.tokenizer, self.drafter, prompts, max_new_tokens=e.spec_max_new_tokens,
                            progress=self.cfg.run.progress)
        keep = {k: m[k] for k in ("tau", "prompts", "rounds", "new_tokens", "seconds")}
        keep.update({f"accept_rate_{k + 1}": v for k, v in enumerate(m["accept_rate"])})
        if logger is not None:
            logger.record(self.state.step, keep, kind="spec_eval")
        say(f"speculative decoding @ step {self.state.step}: tau {m['tau']:.3f} on {m['prompts']} prompts "
            f"({m['seconds']:.0f}s)")
        return keep


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def run_training(cfg: TrainConfig, *, resume: bool) -> int:
    """Single process, or one rank of a torchrun job (pipeline/run.py decides the role)."""
    from dflash_train.pipeline.run import run_rank

    try:
        summary = run_rank(cfg, resume=resume, log=lambda s: print(s, file=sys.stderr, flush=True))
    except TrainingError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if summary is not None:
        print_summary(summary)
    return 0


def print_summary(summary: dict) -> None:
    lines = ["", "training summary", "----------------"]
    lines.append(f"steps {summary['steps']}, {summary['tokens']:,} tokens in {summary['elapsed_s']:.1f}s "
                 f"({summary['tok_per_s']:,.0f} tok/s)")
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
