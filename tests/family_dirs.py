"""Model directories of the tiny families of tests/families.py with the suite's ChatML tokenizer
(tests/conftest.py), for tests that need a target on disk but not the family's own chat template."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.conftest import build_tokenizer
from tests.families import build_model


def save_tiny_family(name: str, directory: Path, seed: int = 0):
    """Tokenizer + random model of family `name` saved to `directory` (a few embedding rows past the
    tokenizer: an unused row for the drafter's MASK token); returns (model, tokenizer)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    model = build_model(name, len(tokenizer) + 8, seed)
    model.save_pretrained(str(directory), safe_serialization=True)
    return model, tokenizer


FP8_BLOCK = 128


def fp8_blocks(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] in DeepSeek-V3's block-FP8 form -> (float8 weight, scale_inv [ceil(out/b), ceil(in/b)],
    the weight dequantized: each block's float8 numbers times its scale, in float32)."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale, back = torch.empty(rows, cols), torch.empty(w.shape)
    for a in range(rows):
        for b in range(cols):
            part = (slice(a * block, (a + 1) * block), slice(b * block, (b + 1) * block))
            scale[a, b] = w[part].abs().max() / 448.0
            q[part] = (w[part] / scale[a, b]).to(torch.float8_e4m3fn)
            back[part] = q[part].float() * scale[a, b]
    return q, scale, back


def save_fp8_family(name: str, directory: Path) -> dict[str, torch.Tensor]:
    """Family `name` (its decoder layers' 2D projections) saved as transformers saves block-FP8
    checkpoints (a float8 `weight` and its `weight_scale_inv`; `quantization_config` quant_method
    fp8), with the suite's tokenizer; returns the model's weights as that checkpoint dequantizes."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    model = build_model(name, len(tokenizer) + 8)
    tensors, expected = {}, {}
    for key, w in model.state_dict().items():
        if ".layers." in key and key.endswith("proj.weight") and w.dim() == 2:
            tensors[key], tensors[key + "_scale_inv"], expected[key] = fp8_blocks(w)
        else:
            tensors[key] = expected[key] = w.contiguous()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (directory / "config.json").write_text(json.dumps(config))
    return expected
