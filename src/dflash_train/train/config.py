"""`dflash-train train` configuration: one YAML file, every field overridable.

    dflash-train train --config run.yaml --optim.lr 3e-4 --run.max_steps 2000

The whole config is validated (types, ranges, cross-field rules) before any model or
dataset is opened, and the resolved config is saved next to the checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_train.data.batching import BatchPlanConfig
from dflash_train.drafter.config import LAYER_TYPES
from dflash_train.drafter.loss import LossConfig
from dflash_train.drafter.step import LABEL_SOURCES
from dflash_train.pipeline.config import PipelineConfig


@dataclass
class TargetConfig:
    path: str = "builtin"  # model directory, .gguf file, or "builtin" (SmolLM2-135M-Instruct)
    dtype: str = "auto"  # auto = bfloat16 on GPU, float32 on CPU
    trust_remote_code: bool = False
    attn_implementation: str = "sdpa"
    fp8: bool = False  # float8 decoder matmuls in the frozen target (Hopper GPUs)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"target.dtype must be auto/bfloat16/float16/float32, got {self.dtype!r}")


@dataclass
class DataConfig:
    path: str = ""  # a dataset directory written by `dflash-train prepare`
    eval_path: str | None = None  # a separate prepared dataset for evaluation
    eval_fraction: float = 0.0  # or hold out this fraction of `path` (deterministic by seed)
    eval_batches: int = 20  # batches per evaluation (0 = the whole eval split)
    plan: BatchPlanConfig = field(default_factory=BatchPlanConfig)
    prefetch: int = 2  # batches prepared ahead by the loader thread

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval_path and self.eval_fraction:
            raise ValueError("give data.eval_path or data.eval_fraction, not both")
        if self.prefetch < 1 or self.eval_batches < 0:
            raise ValueError("data.prefetch must be >= 1 and data.eval_batches >= 0")


@dataclass
class DrafterSpec:
    num_layers: int = 5
    block_size: int = 16
    num_taps: int = 5
    target_layer_ids: list[int] | None = None  # default: spread from 1 to L-3
    mask_token_id: int | None = None  # default: an unused embedding row or special token
    layer_types: list[str] | None = None  # default: all full attention (all sliding if sliding_window)
    sliding_window: int | None = None
    intermediate_size: int | None = None  # default: the target's
    causal_in_block_full: bool = False
    causal_in_block_sliding: bool = True
    init_from: str | None = None  # an exported drafter directory to start from

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_taps < 1:
            raise ValueError("drafter.num_layers and drafter.num_taps must be >= 1")
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2, got {self.block_size}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"drafter.layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"drafter.layer_types: unknown {sorted(unknown)}; use {list(LAYER_TYPES)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError("drafter.sliding_window must be >= 1")


@dataclass
class TrainStepConfig:
    num_anchors: int = 512
    label_source: str = "data"  # data | target | distill
    noise_sigma: float = 0.0
    attention: str = "auto"  # auto = flex on GPU, dense on CPU

    def __post_init__(self) -> None:
        if self.label_source not in LABEL_SOURCES:
            raise ValueError(f"step.label_source must be one of {list(LABEL_SOURCES)}, got {self.label_source!r}")
        if self.attention not in ("auto", "flex", "dense"):
            raise ValueError(f"step.attention must be auto/flex/dense, got {self.attention!r}")
        if self.num_anchors < 1 or self.noise_sigma < 0:
            raise ValueError("step.num_anchors must be >= 1 and step.noise_sigma >= 0")


@dataclass
class OptimConfig:
    lr: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    grad_accum: int = 1  # micro-batches per optimizer step

    def __post_init__(self) -> None:
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("optim.lr must be > 0 and optim.min_lr_ratio in [0, 1]")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.grad_accum < 1:
            raise ValueError("optim.warmup_steps >= 0, optim.grad_clip >= 0 and optim.grad_accum >= 1 are required")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("optim betas must be in [0, 1)")


@dataclass
class RunConfig:
    output_dir: str = "runs/dflash"
    max_steps: int | None = None  # optimizer steps; default: `epochs` over the data
    epochs: float = 1.0
    max_minutes: float = 0.0  # stop (checkpoint, export) after this much training time; 0 = no limit
    seed: int = 0
    device: str = "auto"  # auto = cuda if available
    drafter_dtype: str = "float32"  # master weights; bf16 autocast on GPU either way
    compile: bool = False  # fixed shapes (padded batches, fixed-shape anchors) + torch.compile
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end
    save_every: int = 500
    save_every_minutes: float = 0.0  # also save when this much time passed (0 = off)
    keep_last: int = 3
    checkpoint: bool = True  # write checkpoints and the final drafter (benchmarks turn this off)
    max_bad_steps: int = 5  # stop after this many consecutive non-finite steps
    tensorboard: bool = True
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("run.max_steps must be >= 1")
        if self.epochs <= 0:
            raise ValueError("run.epochs must be > 0")
        if self.max_minutes < 0:
            raise ValueError("run.max_minutes must be >= 0")
        if min(self.log_every, self.save_every, self.keep_last, self.max_bad_steps) < 1 or self.eval_every < 0:
            raise ValueError("run.log_every, save_every, keep_last, max_bad_steps must be >= 1; eval_every >= 0")
        if self.drafter_dtype not in ("float32", "bfloat16"):
            raise ValueError("run.drafter_dtype must be float32 or bfloat16")


@dataclass
class EvalConfig:
    # Prompts for a final check by real speculative decoding (eval/): "builtin" (held-out
    # chat prompts), "humaneval", or a JSONL file. None = off. Its tau is printed next to
    # the eval split's estimate (target labels) and their relative gap.
    spec_prompts: str | None = None
    spec_num_prompts: int = 32  # the first N prompts (0 = all)
    spec_max_new_tokens: int = 128

    def __post_init__(self) -> None:
        if self.spec_num_prompts < 0 or self.spec_max_new_tokens < 1:
            raise ValueError("eval.spec_num_prompts must be >= 0 and eval.spec_max_new_tokens >= 1")


@dataclass
class TrainConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    step: TrainStepConfig = field(default_factory=TrainStepConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if not self.data.path:
            raise ValueError("data.path is required: a dataset directory written by `dflash-train prepare`")
        if self.step.label_source == "distill" and "cap" in self.loss.weighting:
            raise ValueError("loss.weighting 'cap' needs hard labels; use decay with label_source=distill")
        if self.pipeline.queue_depth < self.optim.grad_accum:
            raise ValueError(f"pipeline.queue_depth ({self.pipeline.queue_depth}) must be >= optim.grad_accum "
                             f"({self.optim.grad_accum}): a drafter needs a whole step's batches in flight")
