"""`target:` section of the training config: which frozen model, in which precision, and how
its forward runs (docs/performance.md, "The target forward")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from dflash_train.target.attn_impl import AttnImplementation
from dflash_train.target.language_model import text_config
from dflash_train.target.packed import UnsupportedTarget, check_packed_config
from dflash_train.target.packed_gemma import GEMMA_MODEL_TYPES
from dflash_train.utils.device import DtypeName

SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")
# where target.grouped_kv: auto turns grouped keys on. Gemma's sliding-window layers attend through
# FlexAttention, which reads every key/value head it is given: one per group of query heads halves
# what Gemma-3-27B's windowed layers read (0.54 -> 0.43 ms a layer) and the step gains ~0.9% with
# --overlap (docs/performance.md). Elsewhere the difference stayed within one run's spread.
GROUPED_KV_MODEL_TYPES = GEMMA_MODEL_TYPES


@dataclass
class TargetConfig:
    path: str = "builtin"
    """model directory, .gguf file, 'builtin' (SmolLM2-135M-Instruct), or preset:NAME (random weights, benchmarks)"""
    dtype: DtypeName = "auto"
    """auto = bfloat16 on GPU, float32 on CPU"""
    trust_remote_code: bool = False
    """let transformers run code shipped with the model"""
    attn_implementation: AttnImplementation = "auto"
    """attention of the Hugging Face forward (target.forward: hf): auto = sdpa where the model supports it,
    else eager (Gemma 2, gpt-oss; said once in the log); a choice the model does not support is refused"""
    forward: Literal["auto", "hf", "packed"] = "auto"
    """hf = the model's own forward on documents unpacked from the packed rows (any architecture);
    packed = our layer loop over the same weights on the packed rows themselves: fixed shapes,
    compilable (the families target/packed.py takes); auto = packed on a GPU where the packed forward
    takes the target, else hf (said in one line at the start)"""
    compile: bool | Literal["auto"] = "auto"
    """torch.compile the packed forward's per-layer functions (needs forward: packed; batches are
    padded to one fixed shape); FP8 activation quantisation then fuses into them. auto = on with the
    packed forward on a GPU, off on a CPU"""
    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """force one scaled_dot_product_attention kernel for the target (torch.nn.attention.sdpa_kernel);
    auto = PyTorch's choice. With forward: hf it needs sdpa attention (attn_implementation sdpa, or auto on
    a model that supports sdpa)"""
    document_attention: Literal["gather", "flex"] = "gather"
    """how the packed forward keeps the documents of one row apart: gather = each document
    gathered into a padded [D, L] batch for scaled_dot_product_attention and scattered back;
    flex = FlexAttention on the packed rows themselves under a causal-within-document block
    mask (no gathers; needs forward: packed; sdpa_backend does not apply)"""
    fp8: bool = False
    """float8 decoder matmuls in the frozen target (Hopper GPUs; see docs/performance.md)"""
    grouped_kv: bool | Literal["auto"] = "auto"
    """packed forward: attention reads one key/value head per group of query heads (enable_gqa: the
    cuDNN, flash and FlexAttention kernels take it) instead of copies repeated to every query head,
    which the step writes and attention reads; auto = on for Gemma 2/3 in the packed forward, where it
    was measured faster (docs/performance.md), off elsewhere"""

    def __post_init__(self) -> None:
        # with forward: auto these are checked once the forward is chosen (train/setup.py resolve_fast_path)
        if self.compile is True and self.forward == "hf":
            raise ValueError("target.compile needs target.forward: packed (the Hugging Face forward is not compiled)")
        if self.document_attention == "flex" and self.forward == "hf":
            raise ValueError("target.document_attention: flex needs target.forward: packed")
        if self.grouped_kv is True and self.forward == "hf":
            raise ValueError("target.grouped_kv needs target.forward: packed (the Hugging Face forward repeats them)")
        if self.grouped_kv is True and self.sdpa_backend == "efficient":
            raise ValueError("target.grouped_kv: the memory-efficient SDPA kernel takes no grouped keys: "
                             "use sdpa_backend auto, cudnn or flash")
        # auto is checked once the model is known (train/setup.py check_target_options)
        if self.sdpa_backend != "auto" and self.forward == "hf" and self.attn_implementation not in ("sdpa", "auto"):
            raise ValueError(f"target.sdpa_backend={self.sdpa_backend} needs target.attn_implementation: sdpa "
                             f"(got {self.attn_implementation}) or target.forward: packed")


def decide_forward(t: TargetConfig, model_config, device: torch.device) -> tuple[TargetConfig, str | None]:
    """`t` with `forward`, `compile` and `grouped_kv` decided where they are `auto`, for a target of
    `model_config` on `device`: on a GPU the packed forward, compiled, where it takes the target; else the
    Hugging Face forward, uncompiled (on a CPU compiling costs more than it saves), unless target.compile,
    flex document attention or grouped_kv is set, which only the packed forward has; grouped keys with
    the packed forward on the families of GROUPED_KV_MODEL_TYPES. Also why the packed forward does not
    take the target, when `auto` asked and it does not (else None). ValueError for an explicit value the
    decided forward cannot run."""
    # the packed forward on a GPU, or wherever a setting asks for what only it has
    wants_packed = (device.type == "cuda" or t.compile is True or t.document_attention == "flex"
                    or t.grouped_kv is True)
    why_not = None
    if t.forward == "auto" and wants_packed:
        try:
            check_packed_config(model_config)
        except UnsupportedTarget as exc:
            why_not = str(exc).split(";")[0]  # the reason, without the hint to set target.forward
    forward = t.forward if t.forward != "auto" else ("packed" if wants_packed and why_not is None else "hf")
    compile_ = t.compile if t.compile != "auto" else (device.type == "cuda" and forward == "packed")
    because = f", and it does not take this target ({why_not})" if why_not else ""
    if compile_ is True and forward == "hf":
        raise ValueError(f"target.compile: true needs the packed target forward{because}; set target.compile false")
    if t.document_attention == "flex" and forward == "hf":
        raise ValueError(f"target.document_attention: flex needs the packed target forward{because}")
    if t.grouped_kv is True and forward == "hf":
        raise ValueError(f"target.grouped_kv needs the packed target forward{because}")
    grouped = t.grouped_kv if t.grouped_kv != "auto" else (
        forward == "packed" and t.sdpa_backend != "efficient"
        and getattr(text_config(model_config), "model_type", None) in GROUPED_KV_MODEL_TYPES)
    return dataclasses.replace(t, forward=forward, compile=compile_, grouped_kv=grouped), why_not
