"""The inference checkpoint format (docs/dflash-spec.md, "Checkpoint format").

A directory with `config.json` (Qwen3 fields + `block_size`, `num_target_layers`,
`dflash_config`) and `model.safetensors` with the drafter's own tensors:
`layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `layers.{i}.self_attn.{q,k}_norm.weight`,
`layers.{i}.mlp.{gate,up,down}_proj.weight`, `layers.{i}.{input,post_attention}_layernorm.weight`,
`fc.weight`, `hidden_norm.weight`, `norm.weight`. This is what public DFlash inference
code and serving engines load. Writes are atomic: a temporary directory renamed in place.
The dspark variant's own fields and tensors are drafter/dspark.py's (its "checkpoint" part).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors import safe_open
from safetensors.torch import load_file, save

from dflash_train.drafter import dspark
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.utils.errors import ModelError
from dflash_train.utils.fs import atomic_directory_write

CONFIG_NAME = "config.json"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURES = (DFLASH_ARCHITECTURE, dspark.ARCHITECTURE)  # what load_drafter reads
WEIGHTS_NAME = "model.safetensors"


def to_hf_config(cfg: DrafterConfig, dtype: torch.dtype = torch.bfloat16) -> dict:
    out = {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": list(cfg.layer_types),
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": "sliding_attention" in cfg.layer_types,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "causal_in_block": {
                "full_attention": cfg.causal_in_block_full,
                "sliding_attention": cfg.causal_in_block_sliding,
            },
        },
    }
    if cfg.extra:
        out["dflash_config"]["extra"] = cfg.extra
    dspark.add_checkpoint_fields(out, cfg)
    return out


def from_hf_config(data: dict) -> DrafterConfig:
    dflash = data.get("dflash_config") or {}
    causal = dflash.get("causal_in_block") or {}
    layer_types = data.get("layer_types")
    return DrafterConfig(
        hidden_size=data["hidden_size"],
        num_attention_heads=data["num_attention_heads"],
        num_key_value_heads=data.get("num_key_value_heads", data["num_attention_heads"]),
        head_dim=data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"],
        intermediate_size=data["intermediate_size"],
        vocab_size=data["vocab_size"],
        target_layer_ids=dflash["target_layer_ids"],
        num_target_layers=data["num_target_layers"],
        mask_token_id=dflash["mask_token_id"],
        num_hidden_layers=data["num_hidden_layers"],
        block_size=data["block_size"],
        rms_norm_eps=data.get("rms_norm_eps", 1e-6),
        rope_theta=data.get("rope_theta", 10000.0),
        rope_scaling=data.get("rope_scaling"),
        max_position_embeddings=data.get("max_position_embeddings", 32768),
        layer_types=layer_types,
        sliding_window=data.get("sliding_window") if layer_types and "sliding_attention" in layer_types else None,
        causal_in_block_full=causal.get("full_attention", False),
        causal_in_block_sliding=causal.get("sliding_attention", True),
        **dspark.fields_from_checkpoint(data),
        extra=dflash.get("extra", {}),
    )


def save_drafter(model: DFlashDrafter, directory: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                 job: str | None = None) -> Path:
    """Write the spec's inference checkpoint (config.json + model.safetensors) atomically.
    With `job`, the directory also gets dflash-train's marker file naming that job."""
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}

    def write(tmp: Path) -> None:
        (tmp / CONFIG_NAME).write_text(json.dumps(to_hf_config(model.config, dtype), indent=2) + "\n")
        # written by Python, not by safetensors' own writer: a full disk is then an OSError (ENOSPC),
        # which the CLI reports as one line naming the output (utils/errors.py: storage_error)
        (tmp / WEIGHTS_NAME).write_bytes(save(state, metadata={"format": "pt"}))

    return atomic_directory_write(Path(directory), write, job=job)


def load_drafter_config(directory: str | Path) -> DrafterConfig:
    """The DrafterConfig of a drafter directory (its config.json); ModelError if it is none."""
    path = Path(directory) / CONFIG_NAME
    if not path.is_file():
        raise ModelError(f"{path} is missing: not a DFlash drafter checkpoint")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: not valid JSON ({exc})") from None
    if not set(ARCHITECTURES) & set(data.get("architectures") or []):
        raise ModelError(f"{path}: architectures is {data.get('architectures')}, expected "
                         f"{' or '.join(ARCHITECTURES)}")
    dspark.check_checkpoint(data, path)
    try:
        return from_hf_config(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{path}: not a valid drafter config ({type(exc).__name__}: {exc})") from None


def growth(saved: DrafterConfig, config: DrafterConfig) -> list[str] | None:
    """What `config` adds to the drafter `saved` (drafter.init_from), each part starting so that
    the grown drafter drafts exactly as `saved` until trained: the dspark bigram head on a DFlash
    drafter (`dspark.grow`), and layers after its last one whose layer types extend its own
    (o_proj and down_proj zero: each new layer adds exact zeros to the residual stream).
    [] when the configs are equal, None when `config` is not `saved` grown."""
    grown, added = dspark.grow(saved, config)
    n = saved.num_hidden_layers
    if config.num_hidden_layers > n and config.layer_types[:n] == saved.layer_types:
        grown = dataclasses.replace(grown, num_hidden_layers=config.num_hidden_layers,
                                    layer_types=config.layer_types)
        added.append(f"{config.num_hidden_layers - n} layer(s) after its {n} (o_proj and down_proj zero)")
    return added if grown == config else None


def load_drafter_as(directory: str | Path, config: DrafterConfig) -> DFlashDrafter:
    """The drafter in `directory` as a `config` drafter (drafter.init_from): itself when the configs
    are equal; grown (`growth`) when `config` adds the dspark head or layers after its last: every
    saved tensor kept, the new parts started so that it drafts exactly as saved until trained
    (markov_w1 and the new layers' other weights random: the zeroed weights' first gradients
    need them). ModelError otherwise."""
    saved = load_drafter(directory)
    if saved.config == config:
        return saved
    if growth(saved.config, config) is None:
        raise ModelError(f"{directory}: its drafter config differs from this one")
    model = DFlashDrafter(config)
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    n = saved.config.num_hidden_layers
    new = (dspark.PARAMETER_PREFIX, *(f"layers.{i}." for i in range(n, config.num_hidden_layers)))
    if unexpected or any(not k.startswith(new) for k in missing):  # the model's layout changed
        raise ModelError(f"{directory}: missing tensors {missing}, unexpected tensors {unexpected}")
    dspark.silence_new_head(model, saved)
    with torch.no_grad():
        for layer in model.layers[n:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def load_drafter(directory: str | Path, *, device=None, dtype: torch.dtype | None = None) -> DFlashDrafter:
    directory = Path(directory)
    config = load_drafter_config(directory)
    weights_path = directory / WEIGHTS_NAME
    if not weights_path.is_file():
        raise ModelError(f"{weights_path} is missing: not a DFlash drafter checkpoint")
    check_weights_match_config(directory, config)  # before any memory the config asks for is allocated
    model = DFlashDrafter(config)
    try:
        state = load_file(str(weights_path))
    except (OSError, SafetensorError) as exc:
        raise ModelError(f"{weights_path}: cannot read the weights ({exc})") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ModelError(f"{weights_path}: missing tensors {missing}, unexpected tensors {unexpected}")
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device) if device is not None else model


def check_weights_match_config(directory: Path, config: DrafterConfig) -> None:
    """ModelError naming the first tensors whose presence or shape in model.safetensors is not what
    config.json describes (a config.json edited or copied from another drafter). Compared against a
    drafter built on the meta device: no memory is allocated, whatever sizes config.json names."""
    weights_path = directory / WEIGHTS_NAME
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            found = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (OSError, SafetensorError) as exc:
        raise ModelError(f"{weights_path}: cannot read the weights ({exc})") from None
    try:
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in DFlashDrafter(config).state_dict().items()}
    except (ValueError, TypeError, KeyError, RuntimeError) as exc:
        raise ModelError(f"{directory / CONFIG_NAME}: describes no drafter this version builds ({exc})") from None
    problems = [f"{k} is {list(found[k])} there, config.json makes it {list(v)}"
                for k, v in expected.items() if k in found and found[k] != v]
    problems += [f"{k} is missing there" for k in expected if k not in found]
    problems += [f"{k} is there, config.json has no such tensor" for k in found if k not in expected]
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ModelError(f"{directory}: config.json does not describe model.safetensors: {'; '.join(problems[:3])}"
                         f"{more}; use the config.json exported with these weights")
