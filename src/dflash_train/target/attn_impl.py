"""Which attention implementation a target is loaded with (`attn_implementation`).

`auto` (every job's default) is the fastest the model class supports, sdpa then eager,
decided from the config and the class transformers would build for it, before any weight
is loaded. Support is read from the class attributes transformers itself checks
(`_supports_sdpa`, `_supports_flash_attn`, `_supports_flex_attn`), with one correction:
a model that soft-caps its attention scores (Gemma 2's `attn_logit_softcapping`) never gets
sdpa. transformers 5.25 refuses sdpa for Gemma 2 at load, but 5.17 accepts it and then
drops the soft-capping without a word, which would change every tapped hidden state.

An explicit choice the model does not support is a one-line ModelError naming the model
type and what it does support, before the load; a load that transformers still refuses for
its attention (flash-attn not installed, ...) becomes one as well (`attention_load_error`).
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from dflash_train.target.language_model import text_config
from dflash_train.utils.errors import ModelError

log = logging.getLogger(__name__)

AttnImplementation = Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"]
ATTN_IMPLEMENTATIONS = ("auto", "sdpa", "eager", "flash_attention_2", "flex_attention")
AUTO_ORDER = ("sdpa", "eager")  # what `auto` takes, the first the class supports

_announced: set[tuple[str | None, str]] = set()  # (class or model type, what) already logged by this process


def causal_lm_class(config: Any, *, trust_remote_code: bool = False) -> type | None:
    """The class `AutoModelForCausalLM.from_pretrained` builds for `config` (as transformers picks it
    among several by `architectures`); None when only the model's own code knows it (remote code,
    not imported before the load runs it) or transformers has none (its load then says so)."""
    if trust_remote_code and "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {}):
        return None
    try:
        classes = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None
    if not isinstance(classes, (list, tuple)):
        return classes
    by_name = {c.__name__: c for c in classes}
    return next((by_name[a] for a in getattr(config, "architectures", None) or [] if a in by_name), classes[0])


def _soft_caps_attention(config: Any) -> bool:
    return getattr(text_config(config), "attn_logit_softcapping", None) is not None


def supported_attn_implementations(model_class: type, config: Any) -> list[str]:
    """The implementations `model_class` runs `config` with, fastest first (sdpa, eager, flash, flex)."""
    out = ["sdpa"] if getattr(model_class, "_supports_sdpa", False) and not _soft_caps_attention(config) else []
    out.append("eager")
    if getattr(model_class, "_supports_flash_attn", False) or getattr(model_class, "_supports_flash_attn_2", False):
        out.append("flash_attention_2")
    if getattr(model_class, "_supports_flex_attn", False):
        out.append("flex_attention")
    return out


def resolve_attn_implementation(config: Any, requested: str | None, *, trust_remote_code: bool = False,
                                option: str = "attn_implementation") -> str | None:
    """The `attn_implementation` to load the target with: `requested` when the model supports it
    (ModelError naming `--option` otherwise), or for `auto` (also None) the first of sdpa, eager
    that it supports, logged once when not sdpa. None: leave the choice to transformers (a class
    known only to the model's own code, whose default is the same sdpa-else-eager)."""
    requested = requested or "auto"
    if requested not in ATTN_IMPLEMENTATIONS:
        raise ModelError(f"unknown attention implementation {requested!r}: use --{option} with one of "
                         f"{', '.join(ATTN_IMPLEMENTATIONS)}")
    announce_linear_attention(config)
    cls = causal_lm_class(config, trust_remote_code=trust_remote_code)
    if cls is None:
        return None if requested == "auto" else requested
    supported = supported_attn_implementations(cls, config)
    model_type = getattr(config, "model_type", None)
    if requested == "auto":
        choice = next(i for i in AUTO_ORDER if i in supported)
        announce(model_type, cls.__name__, choice, f", as it does not support sdpa{_why_not_sdpa(config)}")
        return choice
    if requested not in supported:
        why = _why_not_sdpa(config) if requested == "sdpa" else ""
        raise ModelError(f"the target's model type {model_type} ({cls.__name__}) does not support "
                         f"attn_implementation {requested}{why}: use --{option} with one of auto, "
                         f"{', '.join(supported)}")
    return requested


def announce(model_type: str | None, class_name: str, choice: str, why: str) -> None:
    """Log an attention other than sdpa that `auto` led to, once per process and class."""
    if choice != "sdpa" and (class_name, choice) not in _announced:
        _announced.add((class_name, choice))
        log.info("target %s (%s): %s attention%s", model_type, class_name, choice, why)


def announce_linear_attention(config: Any) -> None:
    """Say, once per process and model type, which kernels a hybrid target's linear-attention
    layers (Qwen3.5 and Qwen3-Next's gated delta nets) run: transformers takes
    flash-linear-attention's Triton kernels when `fla` is importable, else a PyTorch recurrence."""
    model_type = getattr(config, "model_type", None)
    layer_types = getattr(text_config(config), "layer_types", None) or []
    if "linear_attention" not in layer_types or (model_type, "linear_attention") in _announced:
        return
    _announced.add((model_type, "linear_attention"))
    if importlib.util.find_spec("fla") is not None:
        log.info("target %s: its linear-attention layers run flash-linear-attention's kernels", model_type)
    else:
        log.info("target %s: its linear-attention layers run transformers' PyTorch recurrence; on a GPU, "
                 "flash-linear-attention's kernels are faster: pip install -e '.[fla]'", model_type)



def _why_not_sdpa(config: Any) -> str:
    return " (it soft-caps its attention scores, which sdpa cannot)" if _soft_caps_attention(config) else ""


_ATTENTION_WORDS = ("attn_implementation", "attention", "sdpa", "flash_attn", "flex_attn")


def attention_load_error(exc: BaseException, implementation: str | None, what: str, *,
                         option: str = "attn_implementation") -> ModelError | None:
    """A load of `what` that transformers refused because of `implementation` (its message is
    about attention) as one line that names `--option eager`; None for any other failure."""
    text = str(exc)
    if not implementation or implementation == "eager" or not any(w in text.lower() for w in _ATTENTION_WORDS):
        return None
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(exc).__name__)
    if len(first) > 300:
        first = first[:297] + "..."
    return ModelError(f"{what}: transformers cannot load it with attn_implementation {implementation} ({first}); "
                      f"use --{option} eager")
