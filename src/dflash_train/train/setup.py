"""Building what a training run needs, cheapest checks first: the drafter config, the frozen
target (or only its embedding and LM head), the drafter itself, its data-parallel and
compiled wrappers, and where each step's (batch, target output) pairs come from.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from dflash_train.data.batch import PackedBatch
from dflash_train.data.batching import BatchPlanner
from dflash_train.data.splits import DataSplits
from dflash_train.drafter.checkpoint import load_drafter_as
from dflash_train.drafter.config import DrafterConfig, build_drafter_config, init_source_layers
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.drafter.step import FrozenHeads, StepConfig, mask_backend
from dflash_train.drafter.target_init import check_target_layers_copyable, copy_target_layers
from dflash_train.pipeline.context import DistContext
from dflash_train.pipeline.sources import BatchSource, LocalTargetSource, RemoteTargetSource
from dflash_train.target.attn_impl import resolve_attn_implementation
from dflash_train.target.config import decide_forward
from dflash_train.target.language_model import final_logit_scale, final_logit_softcap, text_config
from dflash_train.target.loading import (
    choose_mask_token_id,
    load_decoder_layer_tensors,
    load_target_heads,
    load_target_model,
    read_target_config,
)
from dflash_train.target.packed import UnsupportedTarget, check_packed_config
from dflash_train.target.runner import TargetRunner
from dflash_train.target.sharded import load_sharded_target
from dflash_train.train.config import RunConfig, TrainConfig
from dflash_train.train.loader import PrefetchLoader
from dflash_train.utils.config import to_dict
from dflash_train.utils.device import resolve_dtype
from dflash_train.utils.errors import ConfigError, ModelError, TrainingError
from dflash_train.utils.flex_masks import FLEX_MIN_HEAD_DIM

log = logging.getLogger(__name__)


def resolve_drafter_config(cfg: TrainConfig, target_config, tokenizer) -> DrafterConfig:
    """The drafter config on this target; a clear error when the drafter section does not fit."""
    text_cfg = text_config(target_config)
    mask_id = cfg.drafter.mask_token_id
    if mask_id is None:
        try:
            mask_id = (choose_mask_token_id(tokenizer, int(text_cfg.vocab_size)) if tokenizer is not None
                       else int(text_cfg.vocab_size) - 1)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    try:
        return build_drafter_config(cfg.drafter, text_cfg, mask_id)
    except ValueError as exc:
        raise ConfigError(f"the drafter section does not fit the target {cfg.target.path}: {exc}") from None


def resolve_init_layers(cfg: TrainConfig, target_config) -> list[int] | None:
    """The target layer each drafter layer starts as (drafter.init_from_target), or None; a clear
    error when the target's layers cannot be copied. Checked from the config alone."""
    text_cfg = text_config(target_config)
    try:
        ids = init_source_layers(cfg.drafter, int(text_cfg.num_hidden_layers))
        if ids is not None:
            check_target_layers_copyable(text_cfg)
        return ids
    except ValueError as exc:
        raise ConfigError(f"drafter.init_from_target={cfg.drafter.init_from_target} on the target "
                          f"{cfg.target.path}: {exc}") from None


def check_target_options(cfg: TrainConfig, target_config) -> None:
    """The `target:` options that depend on the model, from its config alone (before any weight loads):
    its attention implementation (target/attn_impl.py), an SDPA kernel forced on a model that does not
    run sdpa, and the packed forward on a model it cannot reproduce."""
    t = cfg.target
    attn = resolve_attn_implementation(target_config, t.attn_implementation, trust_remote_code=t.trust_remote_code,
                                       option="target.attn_implementation")
    if t.sdpa_backend != "auto" and t.forward == "hf" and attn not in ("sdpa", None):
        raise ConfigError(f"target.sdpa_backend={t.sdpa_backend} forces an SDPA kernel, but the target "
                          f"({getattr(target_config, 'model_type', None)}) runs {attn} attention, not sdpa: "
                          f"set target.sdpa_backend: auto, or target.forward: packed")
    if t.forward == "packed":
        try:
            check_packed_config(target_config)
        except UnsupportedTarget as exc:
            raise ConfigError(f"target.forward=packed: {exc}") from None


# The settings `auto` picks (docs/training.md, "Fast by default"): the packed compiled target (with
# grouped keys on Gemma), the compiled drafter and bf16 master weights on a GPU; the uncompiled fp32
# path on a CPU, where compiling costs minutes and every step (and the suite's exact comparisons are fp32's).
FAST_PATH_FIELDS = ("target.forward", "target.compile", "target.grouped_kv", "run.compile", "run.drafter_dtype")


def resolve_fast_path(cfg: TrainConfig, target_config, device: torch.device) -> tuple[TrainConfig, str | None]:
    """`cfg` with every `auto` of FAST_PATH_FIELDS decided for this target and device, and one line
    saying what auto chose and why (None when nothing was auto). Explicit values are kept; one that
    the choice makes impossible (target.compile true on a target the packed forward does not take)
    is a ConfigError naming both."""
    run, gpu = cfg.run, device.type == "cuda"
    auto = [k for k in FAST_PATH_FIELDS if config_value(cfg, k) == "auto"]
    try:
        target, packed_no = decide_forward(cfg.target, target_config, device)
    except ValueError as exc:  # an explicit value that auto's choice makes impossible
        raise ConfigError(str(exc)) from None
    compile_ = run.compile if run.compile != "auto" else gpu
    dtype = run.drafter_dtype if run.drafter_dtype != "auto" else ("bfloat16" if gpu else "float32")
    if run.compile_autotune and not compile_:
        raise ConfigError("run.compile_autotune needs run.compile, which auto turns off on a CPU: set run.compile "
                          "true, or leave compile_autotune out")
    resolved = dataclasses.replace(cfg, target=target, run=dataclasses.replace(run, compile=compile_,
                                                                              drafter_dtype=dtype))
    if not auto:
        return resolved, None
    picked = ", ".join(f"{k} {str(config_value(resolved, k)).lower()}" for k in auto)
    if not gpu:
        why = "on a CPU the uncompiled float32 path: compiling pays only on a GPU"
    elif packed_no is None:
        why = f"the fast path on {device}"
    else:
        why = (f"on {device}; the Hugging Face target forward, since the packed one does not take this target "
               f"({packed_no})")
    return resolved, f"auto settings: {picked} ({why}; set any of them to choose)"


def config_value(cfg: TrainConfig, dotted: str):
    """The value of a dotted field (`run.compile`) of `cfg`."""
    section, name = dotted.split(".")
    return getattr(getattr(cfg, section), name)


def total_optimizer_steps(run: RunConfig, grad_accum: int, planner: BatchPlanner, num_drafters: int) -> int:
    """Optimizer steps of the run: run.max_steps, or run.epochs over each drafter's share of
    the real per-epoch batch counts (they vary slightly between epochs: packing follows the
    shuffle). Micro-batches run on across epoch boundaries, so a step may straddle two."""
    if run.max_steps:
        return run.max_steps
    whole, fraction = int(run.epochs), run.epochs - int(run.epochs)
    batches = sum(planner.batches_per_epoch(num_drafters, e) for e in range(whole))
    if fraction:
        batches += math.ceil(fraction * planner.batches_per_epoch(num_drafters, whole))
    return max(1, math.ceil(batches / grad_accum))


@dataclass
class FrozenTarget:
    """This process's part of the target: the whole model and its runner (single and
    colocated layouts), or only the embedding and LM head (a split layout's drafter rank)."""

    heads: FrozenHeads
    model: torch.nn.Module | None = None
    runner: TargetRunner | None = None
    sharded: bool = False  # the model holds 1/G of each weight here (pipeline.target_group_size)


def build_target_runner(cfg: TrainConfig, model: torch.nn.Module, drafter_config: DrafterConfig) -> TargetRunner:
    """The runner of the `target:` section's forward (hf or packed, compiled, SDPA kernel; an `auto` left
    in a config that did not pass through resolve_fast_path decided here, for this model)."""
    target, _ = decide_forward(cfg.target, model.config, model.get_input_embeddings().weight.device)
    try:
        return TargetRunner.from_config(model, drafter_config.target_layer_ids, target,
                                        need_final=cfg.step.label_source != "data")
    except UnsupportedTarget as exc:
        raise ConfigError(f"target.forward=packed: {exc}") from None
    except ValueError as exc:  # layers or final norm not found: a model of a layout we do not know
        raise ModelError(f"target {cfg.target.path}: {exc}") from None


def load_frozen_target(cfg: TrainConfig, drafter_config: DrafterConfig, device: torch.device, *,
                       whole_model: bool, group=None) -> FrozenTarget:
    """`group`: the target group this rank shares a sharded target with (target/sharded.py), else None."""
    t0 = time.perf_counter()
    dtype = resolve_dtype(cfg.target.dtype, device)
    t = cfg.target
    if whole_model and group is not None:  # the drafter's step needs whole copies of the two matrices
        model = load_sharded_target(t.path, dtype=dtype, device=device, group=group, fp8=t.fp8,
                                    trust_remote_code=t.trust_remote_code, attn_implementation=t.attn_implementation)
        embed, head = load_target_heads(t.path, dtype=dtype, device=device, trust_remote_code=t.trust_remote_code)
        log.info("loaded this rank's shard of the target in %.1fs", time.perf_counter() - t0)
        heads = frozen_heads(embed, head, model.config)
        return FrozenTarget(heads, model, build_target_runner(cfg, model, drafter_config), sharded=True)
    if not whole_model:
        embed, head = load_target_heads(t.path, dtype=dtype, device=device, trust_remote_code=t.trust_remote_code)
        heads = frozen_heads(embed, head, read_target_config(t.path, trust_remote_code=t.trust_remote_code))
        log.info("loaded the target's embedding and LM head in %.1fs", time.perf_counter() - t0)
        return FrozenTarget(heads)
    model = load_target_model(t.path, dtype=dtype, device=device, trust_remote_code=t.trust_remote_code,
                              attn_implementation=t.attn_implementation, fp8=t.fp8)
    runner = build_target_runner(cfg, model, drafter_config)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    log.info("loaded the target in %.1fs", time.perf_counter() - t0)
    return FrozenTarget(frozen_heads(embed, head.weight if head is not None else embed, model.config), model, runner)


def frozen_heads(embed: torch.Tensor, head: torch.Tensor, config) -> FrozenHeads:
    """The target's embedding and LM head, with how its forward turns h W^T into logits."""
    return FrozenHeads(embed, head, logit_softcap=final_logit_softcap(config), logit_scale=final_logit_scale(config))


# what a checkpoint's data position (epoch, batch index) means: the batch plan, the split, the shuffle
_DATA_POSITION_IGNORED = {"data.prefetch", "data.eval_batches"}


def data_position_identity(cfg: TrainConfig, data) -> dict:
    """The options and dataset facts that give a data cursor its meaning, flattened: the checkpoint
    records them in its config.yaml (`data_resolved`), `--resume` compares them."""
    flat = {f"data.{k}": v for k, v in flatten(to_dict(cfg.data)).items() if f"data.{k}" not in _DATA_POSITION_IGNORED}
    flat["run.seed"] = cfg.run.seed
    flat["data_resolved.train_samples"] = int(len(data.planner.lengths))
    flat["data_resolved.train_tokens"] = int(data.planner.lengths.sum())
    return flat


def flatten(d: dict, prefix: str = "") -> dict:
    """A nested mapping as {dotted key: leaf value}."""
    out = {}
    for k, v in d.items():
        out.update(flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def data_position_changes(saved_config: dict, now: dict) -> list[str]:
    """`key: saved vs now` for every data-position fact that differs from a checkpoint's resolved config
    (facts an older checkpoint did not record are not compared)."""
    saved = flatten(saved_config)
    out = []
    for key, value in now.items():
        before = saved.get(key, value)
        if key == "data.path" and before != value and Path(str(before)).resolve() == Path(str(value)).resolve():
            continue
        if before != value:
            out.append(f"{key}: {before!r} there vs {value!r} now")
    return out


def config_diff(theirs: DrafterConfig, ours: DrafterConfig) -> str:
    """The fields in which a saved drafter's config differs from this run's, as `name: saved vs this run`."""
    return "; ".join(f"{f.name}: {getattr(theirs, f.name)!r} there vs {getattr(ours, f.name)!r} in this run"
                     for f in dataclasses.fields(ours) if getattr(theirs, f.name) != getattr(ours, f.name))


def build_drafter(cfg: TrainConfig, drafter_config: DrafterConfig, heads: FrozenHeads, device: torch.device, *,
                  init_layers: list[int] | None = None, target_model: torch.nn.Module | None = None) -> DFlashDrafter:
    """The drafter in its master dtype on `device`: loaded from drafter.init_from, or new; with
    `init_layers` (a fresh run's resolve_init_layers) its decoder layers start as copies of those
    target layers, taken from `target_model` when this process holds it (else from the target's files).
    Data-parallel replicas start equal anyway: DDP broadcasts drafter rank 0's weights."""
    if cfg.drafter.init_from:
        drafter = load_drafter_as(cfg.drafter.init_from, drafter_config)  # Trainer checked that it fits
    else:
        with torch.device(device):  # initialised where it trains: seconds on a GPU for a 70B target's 4.6B parameters
            drafter = DFlashDrafter(drafter_config)
        # Start with near-uniform predictions: scale the output norm so that logits
        # through the target's LM head have unit standard deviation. With unit norm
        # weights a large-norm head (SmolLM2's) starts at a cross-entropy of ~37 nats.
        with torch.no_grad():
            head_rms = heads.lm_head_weight.float().pow(2).mean().sqrt()
            drafter.norm.weight.fill_(float(1.0 / (head_rms * drafter_config.hidden_size ** 0.5)))
    master = torch.bfloat16 if cfg.run.drafter_dtype == "bfloat16" else torch.float32
    drafter = drafter.to(device, master).train()
    if init_layers:
        init_drafter_from_target(cfg, drafter, init_layers, device, target_model=target_model)
    return drafter


def init_drafter_from_target(cfg: TrainConfig, drafter: DFlashDrafter, init_layers: list[int], device: torch.device,
                             *, target_model: torch.nn.Module | None = None) -> None:
    """Drafter layer i <- target layer init_layers[i] (drafter/target_init.py), the target's tensors
    in target.dtype exactly as the frozen target holds them."""
    t0 = time.perf_counter()
    t = cfg.target
    tensors = load_decoder_layer_tensors(t.path, init_layers, dtype=resolve_dtype(t.dtype, device), device=device,
                                         trust_remote_code=t.trust_remote_code, model=target_model)
    try:
        report = copy_target_layers(drafter, init_layers, tensors)
    except ValueError as exc:
        raise ConfigError(f"drafter.init_from_target={cfg.drafter.init_from_target}: {exc}") from None
    log.info("drafter layers start as target layers %s (%.1fs): copied %s%s%s", init_layers,
             time.perf_counter() - t0, ", ".join(report.copied),
             f"; kept (no counterpart in the target) {', '.join(report.kept)}" if report.kept else "",
             f"; target tensors left out {', '.join(report.left_out)}" if report.left_out else "")
    if report.left_out:
        log.warning("drafter.init_from_target: target layer tensors without a drafter counterpart were not "
                    "copied: %s", ", ".join(report.left_out))


# run.compile_autotune: Inductor's autotuning, kept to the kernels it generates from templates
# (FlexAttention's forward and backward): matmuls stay cuBLAS, which won every matmul shape
# measured (docs/performance.md), so benchmarking Triton matmuls would only cost compile time
AUTOTUNE_OPTIONS = {"max_autotune": True, "max_autotune_gemm_backends": "ATEN"}


def wrap_drafter(drafter: DFlashDrafter, ctx: DistContext, *, compile: bool,
                 autotune: bool = False) -> torch.nn.Module:
    """What the step calls: the drafter, data-parallel over the drafter ranks, compiled if asked
    (with `autotune`, its attention kernels autotuned)."""
    model: torch.nn.Module = drafter
    if ctx.num_drafters > 1:
        # the drafter's only buffer (RoPE frequencies) is identical everywhere: no syncing
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        model = DistributedDataParallel(drafter, process_group=ctx.drafters, broadcast_buffers=False,
                                        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    if not compile:
        return model
    return torch.compile(model, options=AUTOTUNE_OPTIONS) if autotune else torch.compile(model)


def resolve_attention(requested: str, device: torch.device, head_dim: int) -> str:
    """step.attention -> the drafter's mask kind (drafter/step.py mask_backend). auto: FlexAttention's
    block-sparse kernel on a GPU; the dense mask of the same rule on the CPU (FlexAttention has no CPU
    backward) and for heads narrower than its GPU kernels take (a tiny drafter), said once in the log."""
    if requested == "flex" and device.type != "cuda":
        raise TrainingError("step.attention=flex needs a GPU: FlexAttention has no backward on CPU; use dense")
    if requested == "flex" and head_dim < FLEX_MIN_HEAD_DIM:
        raise TrainingError(f"step.attention=flex needs drafter heads of >= {FLEX_MIN_HEAD_DIM} dims (FlexAttention's "
                            f"GPU kernels), this drafter's are {head_dim}: use step.attention auto or dense")
    chosen = mask_backend(requested, device, head_dim)
    if requested == "auto" and device.type == "cuda" and chosen == "dense":
        log.info("drafter heads of %d dims: the dense attention mask (FlexAttention's GPU kernels need >= %d)",
                 head_dim, FLEX_MIN_HEAD_DIM)
    return chosen


def resolve_step(cfg: TrainConfig, device: torch.device, head_dim: int) -> StepConfig:
    """The `step` section as this run's steps run it: its attention decided for the device, fixed shapes
    in compiled mode."""
    return dataclasses.replace(cfg.step, attention=resolve_attention(cfg.step.attention, device, head_dim),
                               fixed_shape=cfg.run.compile is True)


LOW_FILL = 0.25  # batches less full than this compute mostly padding: said before the run starts
CPU_COMPILE_TOKENS = 4096  # a compiled CPU batch above this many tokens takes minutes to compile and to step
CPU_CONFIG = "src/dflash_train/assets/demo_cpu.yaml"  # the CPU-sized config the README names


def start_warnings(cfg: TrainConfig, planner: BatchPlanner, device: torch.device) -> list[str]:
    """What a newcomer's first run gets wrong, said before the long wait: batches that are mostly
    padding (a small dataset under a large token budget), and a large compiled shape on a CPU."""
    plan = cfg.data.plan
    out = []
    batches = max(len(planner.plan(0)), 1)
    fill = float(planner.lengths.sum()) / (batches * plan.token_budget)
    if fill < LOW_FILL:
        out.append(f"batches are only {fill:.1%} full ({int(planner.lengths.sum()):,} tokens in {batches:,} batches of "
                   f"data.plan.token_budget {plan.token_budget:,}): most of every step is padding; a smaller "
                   f"data.plan.token_budget (the longest sample has {int(planner.lengths.max()):,} tokens) "
                   f"or more data fits better")
    shape = compile_padding(cfg)
    if shape is not None and device.type == "cpu" and shape[0] * shape[1] > CPU_COMPILE_TOKENS:
        out.append(f"compiling for {shape[0]} x {shape[1]:,}-token batches on a CPU (run.compile / target.compile): "
                   f"the first steps wait minutes for torch.compile and every step is slow at this shape; for a CPU, "
                   f"start from {CPU_CONFIG} (no compile, 512-token batches)")
    return out


def announce_start(cfg: TrainConfig, planner: BatchPlanner, device: torch.device) -> None:
    """The start warnings, and a "compiling" line before the first step's wait for the compiler."""
    for line in start_warnings(cfg, planner, device):
        log.warning("%s", line)
    shape = compile_padding(cfg)
    if shape is not None:
        what = " and ".join(w for w, on in (("the drafter", cfg.run.compile), ("the target", cfg.target.compile))
                            if on is True)
        log.info("compiling ... %s for %d x %d-token batches: the first step waits for torch.compile", what, *shape)


def compile_padding(cfg: TrainConfig) -> tuple[int, int] | None:
    """The fixed [rows, row length] every batch is padded to in compiled mode (a compiled
    drafter or target), else None."""
    plan = cfg.data.plan
    compiled = cfg.run.compile is True or cfg.target.compile is True  # an unresolved auto: not (yet) compiled
    return (plan.max_rows, int(plan.row_tokens)) if compiled else None


def pad_batch(batch: PackedBatch, shape: tuple[int, int] | None) -> PackedBatch:
    return batch if shape is None else batch.pad_to(*shape)


def build_batch_source(cfg: TrainConfig, ctx: DistContext, data: DataSplits, target: FrozenTarget,
                       drafter_config: DrafterConfig, *, start: tuple[int, int], budget: int) -> BatchSource:
    """(batch, target output) pairs for this drafter: the target runs here (Local), or on a
    target rank of the split layout and the hidden states arrive (Remote)."""
    epochs = None if cfg.run.max_steps else int(math.ceil(cfg.run.epochs))
    batches = data.planner.iter_batches(data.train, start=start, epochs=epochs,
                                        rank=ctx.drafter_index if ctx.num_drafters > 1 else 0, world=ctx.num_drafters)
    shape = compile_padding(cfg)
    loader = PrefetchLoader(batches, depth=max(cfg.data.prefetch, cfg.pipeline.queue_depth + 1),
                            pin_memory=ctx.device.type == "cuda", prepare=lambda b: pad_batch(b, shape))
    if target.runner is not None:
        return LocalTargetSource(loader, target.runner, ctx.device, overlap=cfg.pipeline.overlap_target)
    return RemoteTargetSource(
        loader, ctx, taps_width=drafter_config.num_taps * drafter_config.hidden_size,
        hidden=drafter_config.hidden_size, need_final=cfg.step.label_source != "data",
        dtype=resolve_dtype(cfg.target.dtype, ctx.device), queue_depth=cfg.pipeline.queue_depth, budget=budget)
