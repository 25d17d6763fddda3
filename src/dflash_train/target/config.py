"""`target:` section of the training config: which frozen model, in which precision, and how
its forward runs (docs/performance.md, "The target forward")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dflash_train.target.attn_impl import AttnImplementation
from dflash_train.utils.device import DtypeName

SDPA_BACKENDS = ("auto", "flash", "cudnn", "efficient", "math")


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
    forward: Literal["hf", "packed"] = "hf"
    """hf = the model's own forward on documents unpacked from the packed rows (any architecture);
    packed = our layer loop over the same weights on the packed rows themselves: fixed shapes,
    compilable (Llama, Mistral, Qwen2, Qwen3 decoders; target/packed.py)"""
    compile: bool = False
    """torch.compile the packed forward's per-layer functions (needs forward: packed; batches are
    padded to one fixed shape); FP8 activation quantisation then fuses into them"""
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

    def __post_init__(self) -> None:
        if self.compile and self.forward != "packed":
            raise ValueError("target.compile needs target.forward: packed (the Hugging Face forward is not compiled)")
        if self.document_attention == "flex" and self.forward != "packed":
            raise ValueError("target.document_attention: flex needs target.forward: packed")
        # auto is checked once the model is known (train/setup.py check_target_options)
        if self.sdpa_backend != "auto" and self.forward == "hf" and self.attn_implementation not in ("sdpa", "auto"):
            raise ValueError(f"target.sdpa_backend={self.sdpa_backend} needs target.attn_implementation: sdpa "
                             f"(got {self.attn_implementation}) or target.forward: packed")
