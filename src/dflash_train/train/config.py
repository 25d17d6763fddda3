"""`dflash-train train` configuration: one YAML file, every field overridable.

    dflash-train train --config run.yaml --optim.lr 3e-4 --run.max_steps 2000

Each section's class lives with the part of the system it configures (target/, data/,
drafter/, pipeline/); the sections of the training loop itself are here. The whole
config is validated (types, ranges, cross-field rules) before any model or dataset is
opened, and the resolved config is saved next to the checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from dflash_train.data.config import DataConfig
from dflash_train.drafter import dspark
from dflash_train.drafter.config import DrafterSpec
from dflash_train.drafter.loss import CONFIDENCE_WEIGHTINGS, LossConfig
from dflash_train.drafter.step import StepConfig
from dflash_train.pipeline.config import PipelineConfig
from dflash_train.target.config import TargetConfig
from dflash_train.train.profiling import parse_profile_steps
from dflash_train.utils.config import refuse_unread

DECAY_FRACTION = 0.2  # optim.decay_fraction's default: another value without schedule wsd is refused


@dataclass
class OptimConfig:
    lr: float = 6e-4
    """peak learning rate (AdamW)"""
    min_lr_ratio: float = 0.1
    """the schedule decays to lr * min_lr_ratio"""
    warmup_steps: int = 100
    """linear warmup steps"""
    schedule: Literal["cosine", "wsd"] = "cosine"
    """after the warmup: cosine decay, or warmup-stable-decay (wsd: the peak lr, then a linear
    decay over the last decay_fraction of the steps)"""
    decay_fraction: float = DECAY_FRACTION
    """wsd: the share of all steps spent decaying"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    beta1: float = 0.9
    """AdamW beta1"""
    beta2: float = 0.95
    """AdamW beta2"""
    eps: float = 1e-8
    """AdamW epsilon"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this (0 disables clipping)"""
    grad_accum: int = 1
    """micro-batches per optimizer step"""
    markov_lr_scale: float = 1.0
    """drafter.variant dspark: the bigram head's tables (markov_w1, markov_w2) train at lr times
    this, in their own parameter group under the same schedule. markov_w2 starts at zero and
    AdamW moves each entry by about lr a step, so in a short run the head's bias may stay far
    below the LM head's logits at the backbone's lr"""
    compiled_step: bool = True
    """in compiled mode (run.compile): the AdamW step as one Inductor-generated pass per tensor
    (train/optimizer.CompiledAdamW, ~1.4x faster than the fused kernel on an H200); false: torch's
    fused AdamW. Same update, same checkpoint format"""

    def __post_init__(self) -> None:
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("optim.lr must be > 0 and optim.min_lr_ratio in [0, 1]")
        if self.schedule not in ("cosine", "wsd"):
            raise ValueError(f"optim.schedule must be cosine or wsd, got {self.schedule!r}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"optim.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        refuse_unread(self, "optim", {"decay_fraction": DECAY_FRACTION}, "schedule", "wsd")
        if self.warmup_steps < 0 or self.grad_clip < 0 or self.grad_accum < 1:
            raise ValueError("optim.warmup_steps >= 0, optim.grad_clip >= 0 and optim.grad_accum >= 1 are required")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError("optim betas must be in [0, 1)")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError("optim.eps must be > 0 and optim.weight_decay >= 0")
        if not self.markov_lr_scale > 0:
            raise ValueError(f"optim.markov_lr_scale must be > 0, got {self.markov_lr_scale}")


@dataclass
class RunConfig:
    output_dir: str = "runs/dflash"
    """where checkpoints, metrics, the final drafter and the resolved config go"""
    max_steps: int | None = None
    """optimizer steps (default: `epochs` over the data)"""
    epochs: float = 1.0
    """passes over the training data when max_steps is not set"""
    max_minutes: float = 0.0
    """stop (checkpoint, final drafter, evaluation) after this much training time; 0 = no limit"""
    fit_schedule: bool = False
    """with max_minutes: once the rate is measured (the second log window), shorten the schedule
    (max_steps, or the epochs' steps: the most the run does) to what 95% of the time box holds, so
    the learning rate has decayed when the box ends, and refit it at later log windows when the
    recent rate (the median of the last five windows) moves the fit (docs/training.md); the fitted
    length is kept across resumes. No effect without a box (a short run with run.max_minutes 0
    keeps its max_steps)"""
    seed: int = 0
    """seed of initialisation, anchors, noise and the eval split"""
    resume_with_other_data: bool = False
    """with --resume: continue from the checkpoint's data position although the data options, the seed or
    the dataset differ from the checkpoint's (that position then points at other batches); else refused"""
    device: str = "auto"
    """auto (this rank's GPU, else CPU), cpu, cuda, cuda:N"""
    drafter_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """master weights of the drafter (bf16 autocast on GPU either way); auto = bfloat16 on a GPU (less
    memory, a faster optimizer step), float32 on a CPU"""
    compile: bool | Literal["auto"] = "auto"
    """fixed shapes (padded batches, fixed-shape anchors) + torch.compile; auto = on on a GPU (one
    compile of about a minute at the start), off on a CPU (there it costs minutes and every step)"""
    compile_autotune: bool = False
    """with compile: Inductor benchmarks its own kernel choices for the drafter's FlexAttention
    (forward and backward) once per shape, at the first step (2-3 minutes on an H200, where it
    made the attention backward ~15% faster, 2-3 ms a step at the qwen3-8b preset:
    docs/performance.md); matmuls stay cuBLAS"""
    threads: int = 0
    """CPU threads for torch on CPU runs (0: the cores other processes leave idle)"""
    log_every: int = 10
    """log a metrics line every this many steps"""
    eval_every: int = 0
    """evaluate every this many steps (0 = only at the end)"""
    save_every: int = 500
    """checkpoint every this many steps"""
    save_every_minutes: float = 0.0
    """also checkpoint when this much time passed since the last one (0 = off)"""
    keep_last: int = 3
    """checkpoints kept"""
    checkpoint: bool = True
    """write checkpoints and the final drafter (benchmarks turn this off)"""
    max_bad_steps: int = 5
    """stop after this many consecutive non-finite steps"""
    tensorboard: bool = True
    """also write TensorBoard event files"""
    progress: bool = True
    """show a progress bar"""
    profile_steps: str = ""
    """FIRST-LAST: torch.profiler over these optimizer steps (1-based; after the first log window,
    which holds the compiles); the top ops and kernels go to <output_dir>/profile/ ('' = off)"""

    def __post_init__(self) -> None:
        parse_profile_steps(self.profile_steps)
        if self.compile_autotune and self.compile is False:
            raise ValueError("run.compile_autotune needs run.compile: true")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("run.max_steps must be >= 1")
        if self.epochs <= 0:
            raise ValueError("run.epochs must be > 0")
        if self.max_minutes < 0 or self.save_every_minutes < 0 or self.threads < 0:
            raise ValueError("run.max_minutes, run.save_every_minutes and run.threads must be >= 0")
        if min(self.log_every, self.save_every, self.keep_last, self.max_bad_steps) < 1 or self.eval_every < 0:
            raise ValueError("run.log_every, save_every, keep_last, max_bad_steps must be >= 1; eval_every >= 0")


@dataclass
class EvalConfig:
    spec_prompts: str | None = "heldout"
    """prompts decoded by real speculative decoding at every evaluation (run.eval_every and the end):
    'heldout' (the eval split's prompts, held out by prompt), 'builtin' (held-out chat prompts),
    'humaneval', or a JSONL file; null = off. Its tau is logged next to the eval split's estimate"""
    spec_num_prompts: int = 64
    """the first N prompts (0 = all)"""
    spec_max_new_tokens: int = 128
    """tokens generated per prompt; the estimate covers the same answer positions"""
    spec_slots: int = 64
    """prompts decoded at once"""

    def __post_init__(self) -> None:
        if self.spec_num_prompts < 0 or self.spec_max_new_tokens < 2 or self.spec_slots < 1:
            raise ValueError("eval.spec_num_prompts must be >= 0, eval.spec_max_new_tokens >= 2, eval.spec_slots >= 1")


@dataclass
class TrainConfig:
    # what a run records in the config.yaml it saves beside its options (train/trainer.py): left out when
    # that file is read back as --config
    RUN_RECORD_KEYS: ClassVar[tuple[str, ...]] = ("drafter_resolved", "data_resolved")

    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    step: StepConfig = field(default_factory=StepConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.optim.markov_lr_scale != 1.0 and not dspark.enabled(self.drafter):
            raise ValueError(f"optim.markov_lr_scale ({self.optim.markov_lr_scale}) scales the dspark bigram head's "
                             f"learning rate; drafter.variant is {self.drafter.variant!r}, which has no such head")
        if self.step.label_source == "distill" and self.loss.weighting in CONFIDENCE_WEIGHTINGS:
            raise ValueError(f"loss.weighting '{self.loss.weighting}' needs hard labels; use decay with "
                             "label_source=distill")
        if self.pipeline.queue_depth < self.optim.grad_accum:
            raise ValueError(f"pipeline.queue_depth ({self.pipeline.queue_depth}) must be >= optim.grad_accum "
                             f"({self.optim.grad_accum}): a drafter needs a whole step's batches in flight")
