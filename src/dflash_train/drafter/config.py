"""The drafter's configuration, validated at construction, and its derivation from a target.

A DFlash drafter is a small Qwen3-style decoder whose hidden size equals the target's and
which is conditioned on `n` tapped target layers (see docs/dflash-spec.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_train.drafter import dspark
from dflash_train.target.language_model import text_config
from dflash_train.utils.config import refuse_unread

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
# "dflash": every block slot is drafted independently (the spec). "dspark": DFlash plus a bigram
# head over the block; drafter/dspark.py holds all it adds.
VARIANTS = ("dflash", dspark.VARIANT)


def default_target_layer_ids(num_target_layers: int, num_taps: int = 5) -> list[int]:
    """`num_taps` decoder-layer ids spread evenly from 1 to L - 3 (0-based, distinct).

    Rounds half up (not Python's banker's rounding) so the choice is easy to reproduce by
    hand. Small targets get fewer taps when the range has fewer distinct layers.
    """
    if num_target_layers < 1:
        raise ValueError(f"the target needs at least one decoder layer, got {num_target_layers}")
    lo = min(1, num_target_layers - 1)
    hi = max(lo, num_target_layers - 3)
    if num_taps == 1:
        return [(lo + hi) // 2]
    ids = [int(math.floor(lo + i * (hi - lo) / (num_taps - 1) + 0.5)) for i in range(num_taps)]
    return sorted(set(ids))


@dataclass
class DrafterConfig:
    """Every shape and semantic choice of a drafter. Field names follow Hugging Face Qwen3."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    target_layer_ids: list[int]
    num_target_layers: int
    mask_token_id: int
    num_hidden_layers: int = 5
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Hugging Face rope scaling dict copied from the target (None = plain RoPE).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    # One entry per layer: "full_attention" or "sliding_attention". None = all full.
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # Whether block tokens see only earlier slots of their own block, per layer type.
    # Spec defaults: full layers bidirectional, sliding layers causal (serving engines assume it).
    causal_in_block_full: bool = False
    causal_in_block_sliding: bool = True
    variant: str = "dflash"
    # The dspark variant's bigram head (drafter/dspark.py): rank r (markov_w1, markov_w2 [V, r]) and
    # type (dspark.HEAD_TYPES: gated adds gate_proj [r, H + r] and bias [r]). dflash has no such head.
    markov_rank: int = dspark.DEFAULT_RANK
    markov_head_type: str = "vanilla"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = [FULL] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        positive = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size", "vocab_size", "num_hidden_layers", "num_target_layers",
                    "max_position_embeddings")
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one draft slot), got {self.block_size}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            raise ValueError(f"target_layer_ids has duplicates: {self.target_layer_ids}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are outside the target's decoder layers "
                f"0..{self.num_target_layers - 1}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the embedding table (vocab_size {self.vocab_size})"
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"unknown layer types {unknown}; use {list(LAYER_TYPES)}")
        if SLIDING in self.layer_types:
            if self.sliding_window is None or self.sliding_window < 1:
                raise ValueError("sliding_attention layers need sliding_window >= 1")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.variant not in VARIANTS:
            raise ValueError(f"drafter variant must be one of {list(VARIANTS)}, got {self.variant!r}")
        dspark.check_config(self)

    # ---- derived values -------------------------------------------------------------
    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def causal_in_block_of(self, layer: int) -> bool:
        return self.causal_in_block_sliding if self.layer_types[layer] == SLIDING else self.causal_in_block_full

    def mask_variants(self) -> list[tuple[int | None, bool]]:
        """Distinct (window, causal_in_block) pairs: one attention mask is built per pair."""
        seen: list[tuple[int | None, bool]] = []
        for i in range(self.num_hidden_layers):
            key = (self.window_of(i), self.causal_in_block_of(i))
            if key not in seen:
                seen.append(key)
        return seen


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def rope_settings_of(target_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) of a Hugging Face config, across transformers 4.x and 5.x."""
    params = getattr(target_config, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type rope (e.g. Gemma-style configs)
    if isinstance(params, dict) and params:
        theta = float(params.get("rope_theta", _get(target_config, "rope_theta", default=10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return theta, scaling
    theta = float(_get(target_config, "rope_theta", default=10000.0))
    scaling = getattr(target_config, "rope_scaling", None)
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, (dict(scaling) if scaling else None)


def drafter_config_from_target(
    target_config: Any,
    *,
    mask_token_id: int,
    num_hidden_layers: int = 5,
    block_size: int = 16,
    num_taps: int = 5,
    target_layer_ids: list[int] | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    intermediate_size: int | None = None,
    **overrides: Any,
) -> DrafterConfig:
    """Derive a drafter config from any Hugging Face causal-LM config.

    Attention shapes, norm eps and RoPE come from the target (the drafter shares its
    embedding space and position encoding); only depth, block size and taps are ours.
    """
    text_cfg = text_config(target_config)  # a multimodal target's language model
    hidden = int(text_cfg.hidden_size)
    heads = int(text_cfg.num_attention_heads)
    kv_heads = int(_get(text_cfg, "num_key_value_heads", default=heads))
    head_dim = int(_get(text_cfg, "head_dim", default=hidden // heads))
    n_layers = int(text_cfg.num_hidden_layers)
    theta, scaling = rope_settings_of(text_cfg)
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(n_layers, num_taps)
    inter = intermediate_size or int(_get(text_cfg, "intermediate_size", default=4 * hidden))
    if layer_types is None:
        layer_types = [SLIDING if sliding_window else FULL] * num_hidden_layers
    return DrafterConfig(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=int(text_cfg.vocab_size),
        target_layer_ids=list(target_layer_ids),
        num_target_layers=n_layers,
        mask_token_id=mask_token_id,
        num_hidden_layers=num_hidden_layers,
        block_size=block_size,
        rms_norm_eps=float(_get(text_cfg, "rms_norm_eps", "layer_norm_eps", default=1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(_get(text_cfg, "max_position_embeddings", default=32768)),
        layer_types=layer_types,
        sliding_window=sliding_window,
        **overrides,
    )


@dataclass
class DrafterSpec:
    """`drafter:` section of the training config: what to build; the rest comes from the target."""

    num_layers: int = 5
    """drafter decoder layers"""
    block_size: int = 16
    """tokens per block: the anchor plus block_size - 1 drafted tokens"""
    num_taps: int = 5
    """tapped target layers (spread from layer 1 to L-3 unless target_layer_ids is given)"""
    target_layer_ids: list[int] | None = None
    """0-based target decoder layers whose outputs condition the drafter (default: spread evenly)"""
    mask_token_id: int | None = None
    """token id of MASK (default: an unused embedding row or special token)"""
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    """one per layer (default: all full attention, or all sliding with sliding_window)"""
    sliding_window: int | None = None
    """window of sliding-attention layers, in tokens"""
    intermediate_size: int | None = None
    """MLP width (default: the target's)"""
    causal_in_block_full: bool = False
    """block tokens of full-attention layers see only earlier slots of their block"""
    causal_in_block_sliding: bool = True
    """the same for sliding-window layers (serving engines assume causal)"""
    init_from: str | None = None
    """an exported drafter directory to start from"""
    init_from_target: Literal["none", "last", "spread", "layers"] = "none"
    """start each drafter decoder layer as a copy of a target decoder layer (attention projections, MLP,
    norms; a fresh run only, --resume loads its checkpoint): none = random init; last = the target's
    last num_layers layers; spread = num_layers layers evenly spaced (the middle of num_layers equal
    spans); layers = the ids in init_target_layers"""
    init_target_layers: list[int] | None = None
    """with init_from_target=layers: one 0-based target layer id per drafter layer, in drafter order"""
    variant: Literal["dflash", "dspark"] = "dflash"
    """dflash = slots drafted independently; dspark = plus a low-rank bigram head that conditions each
    slot on the token before it (docs/dflash-spec.md, "Variant: dspark")"""
    markov_rank: int = dspark.DEFAULT_RANK
    """dspark only: rank r of the bigram head (two [vocab, r] tables; at most the vocabulary's size)"""
    markov_head: Literal["vanilla", "gated"] = "vanilla"
    """dspark only: vanilla = the bias reads the previous token alone; gated = its code is gated by
    the slot's hidden state (DSpark's gated head: one [r, H + r] projection more)"""

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.num_taps < 1:
            raise ValueError("drafter.num_layers and drafter.num_taps must be >= 1")
        if self.init_from_target == "layers":
            if self.init_target_layers is None or len(self.init_target_layers) != self.num_layers:
                got = "none" if self.init_target_layers is None else f"{len(self.init_target_layers)}"
                raise ValueError(f"drafter.init_from_target=layers needs drafter.init_target_layers with one target "
                                 f"layer id per drafter layer ({self.num_layers}), got {got}")
            if min(self.init_target_layers) < 0:
                raise ValueError(f"drafter.init_target_layers must be >= 0, got {self.init_target_layers}")
        refuse_unread(self, "drafter", {"init_target_layers": None}, "init_from_target", "layers")
        if self.init_from_target != "none" and self.init_from:
            raise ValueError("drafter.init_from and drafter.init_from_target both set the starting weights; "
                             "choose one")
        if self.block_size < 2:
            raise ValueError(f"drafter.block_size must be >= 2, got {self.block_size}")
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ValueError(f"drafter.layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError("drafter.sliding_window must be >= 1")
        if self.variant not in VARIANTS:
            raise ValueError(f"drafter.variant must be one of {list(VARIANTS)}, got {self.variant!r}")
        dspark.check_spec(self)


def spread_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` distinct target layer ids, the middle of each of `count` equal spans of 0..L-1
    (floor((i + 1/2) * L / count)): L=30, count=5 -> [3, 9, 15, 21, 27]."""
    if not 1 <= count <= num_target_layers:
        raise ValueError(f"cannot pick {count} distinct layers of a target with {num_target_layers}")
    return [int((2 * i + 1) * num_target_layers // (2 * count)) for i in range(count)]


def init_source_layers(spec: DrafterSpec, num_target_layers: int) -> list[int] | None:
    """The target decoder layer each drafter layer starts as (drafter.init_from_target), in drafter
    order; None for a random start. ValueError when the target has too few layers."""
    n, L = spec.num_layers, num_target_layers
    if spec.init_from_target == "none":
        return None
    if spec.init_from_target == "layers":
        ids = [int(i) for i in spec.init_target_layers or []]
        bad = [i for i in ids if not 0 <= i < L]
        if bad:
            raise ValueError(f"drafter.init_target_layers {bad} are outside the target's decoder layers 0..{L - 1}")
        return ids
    if n > L:
        raise ValueError(f"drafter.init_from_target={spec.init_from_target}: {n} drafter layers, but the target "
                         f"has only {L}")
    return list(range(L - n, L)) if spec.init_from_target == "last" else spread_layer_ids(L, n)


def build_drafter_config(spec: DrafterSpec, target_config: Any, mask_token_id: int) -> DrafterConfig:
    """The drafter config for `spec` on a target (its Hugging Face config); ValueError if it does not fit."""
    text_cfg = text_config(target_config)
    return drafter_config_from_target(
        text_cfg,
        mask_token_id=mask_token_id,
        num_hidden_layers=spec.num_layers,
        block_size=spec.block_size,
        num_taps=spec.num_taps,
        target_layer_ids=spec.target_layer_ids,
        layer_types=spec.layer_types,
        sliding_window=spec.sliding_window,
        intermediate_size=spec.intermediate_size,
        causal_in_block_full=spec.causal_in_block_full,
        causal_in_block_sliding=spec.causal_in_block_sliding,
        variant=spec.variant,
        markov_rank=spec.markov_rank,
        markov_head_type=spec.markov_head,
    )


def mismatches_with_target(cfg: DrafterConfig, target_config: Any) -> list[str]:
    """Why a drafter cannot run on a target (empty if it can), from the target's config alone."""
    text_cfg = text_config(target_config)
    problems = []
    if cfg.hidden_size != int(text_cfg.hidden_size):
        problems.append(f"hidden size {cfg.hidden_size} != target's {text_cfg.hidden_size}")
    if cfg.num_target_layers != int(text_cfg.num_hidden_layers):
        problems.append(f"trained for a target with {cfg.num_target_layers} layers, this one has "
                        f"{text_cfg.num_hidden_layers}")
    if cfg.mask_token_id >= int(text_cfg.vocab_size):
        problems.append(f"mask token {cfg.mask_token_id} is outside the target's embedding "
                        f"({text_cfg.vocab_size} rows)")
    return problems
