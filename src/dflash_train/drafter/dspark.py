"""The dspark variant (docs/dflash-spec.md, "Variant: dspark"): DFlash plus a bigram head.

The DFlash backbone drafts every slot of a block at once; this head adds back a first-order
dependency inside the block. The logits of slot k are

    lm_head(h_k) + markov_w2 @ markov_w1[x_{k-1}]         (markov_w1, markov_w2: [V, r])

where x_{k-1} is the token before slot k: the anchor for k = 1, then the token drafted (at
inference) or taught (in training) for slot k - 1. The gated head (DSpark's "gated") scales
that code per slot by the slot's hidden state:

    code_k = sigmoid(gate_proj([h_k ; e])) * e,   e = markov_w1[x_{k-1}]

(gate_proj [r, H + r]), so the bias of a previous token depends on the context. Both parts are
one matmul over the concatenation [h_k ; code_k] against [lm_head | markov_w2]: the loss
(drafter/head_kernel.py) takes the wider hidden state and markov_w2 as a trainable tail of the head.

Everything the variant adds lives here, and the rest of the code asks this module rather than
comparing `variant` itself:

    config       `check_config`, `check_spec`        the fields' validation (drafter/config.py)
    model        `build_head`                        `DFlashDrafter.markov_head` (drafter/model.py)
    training     `previous_tokens`, `MarkovHead.widen`   teacher forcing (drafter/step.py)
    decoding     `markov_drafts`, `draft_head`       left-to-right drafts (speculative/)
    checkpoint   `add_checkpoint_fields`, `fields_from_checkpoint`, `check_checkpoint`, `grow`,
                 `silence_new_head`                  (drafter/checkpoint.py)

Shapes: S sequences, R rows, N blocks of B slots, H hidden, V vocabulary, r the head's rank.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_train.drafter.labels import block_label_positions
from dflash_train.target.ops import rms_norm
from dflash_train.utils.config import refuse_unread
from dflash_train.utils.errors import ModelError

if TYPE_CHECKING:
    from dflash_train.drafter.config import DrafterConfig, DrafterSpec
    from dflash_train.drafter.model import DFlashDrafter

VARIANT = "dspark"  # drafter.variant
HEAD_TYPES = ("vanilla", "gated")  # the bias from the previous token alone, or gated by the slot's hidden state
DEFAULT_RANK = 256  # drafter.markov_rank's default: another value without variant dspark is refused
PARAMETER_PREFIX = "markov_head."  # the head's parameters and checkpoint tensors: DFlashDrafter.markov_head
ARCHITECTURE = "DSparkDraftModel"  # config.json's architecture (vLLM's Qwen3 DSpark drafter)
PROJECTOR_TYPE = "dspark"  # config.json's projector_type


def enabled(cfg: DrafterConfig | DrafterSpec) -> bool:
    """Whether a drafter config (or the `drafter:` section) is of the dspark variant."""
    return cfg.variant == VARIANT


# ---- config ---------------------------------------------------------------------------------------

def check_config(cfg: DrafterConfig) -> None:
    """ValueError where a DrafterConfig's bigram-head fields are unusable (a DFlash drafter's
    defaults pass); the variant's name itself is checked by the config."""
    if cfg.markov_head_type not in HEAD_TYPES:
        raise ValueError(f"drafter markov_head_type must be one of {list(HEAD_TYPES)}, got {cfg.markov_head_type!r}")
    rank = cfg.markov_rank
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"drafter markov_rank must be an integer >= 1, got {rank!r}")
    if enabled(cfg) and rank > cfg.vocab_size:
        raise ValueError(f"markov_rank (drafter.markov_rank) {rank:,} is above the vocabulary size "
                         f"{cfg.vocab_size:,}: the bigram head's tables are [vocab, rank], and a rank above the "
                         f"vocabulary adds nothing")


def check_spec(spec: DrafterSpec) -> None:
    """ValueError where the `drafter:` section's bigram-head options are unusable, or set (away from
    their defaults) on a variant that has no bigram head and would ignore them."""
    if spec.markov_rank < 1:
        raise ValueError(f"drafter.markov_rank must be >= 1, got {spec.markov_rank}")
    if spec.markov_head not in HEAD_TYPES:
        raise ValueError(f"drafter.markov_head must be one of {list(HEAD_TYPES)}, got {spec.markov_head!r}")
    refuse_unread(spec, "drafter", {"markov_rank": DEFAULT_RANK, "markov_head": "vanilla"}, "variant", VARIANT)


# ---- the head -------------------------------------------------------------------------------------

class MarkovHead(nn.Module):
    """markov_w1: token -> r-dim code; markov_w2: code -> a bias over the vocabulary; gated:
    gate_proj, [h ; code] -> the code's per-slot gate. The names are the tensors' names in the
    exported checkpoint (`markov_head.markov_w{1,2}.weight`, `markov_head.gate_proj.{weight,bias}`)."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int, head_type: str = "vanilla"):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)  # weight [V, r]
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)  # weight [V, r]
        self.gate_proj = nn.Linear(hidden_size + rank, rank) if head_type == "gated" else None  # [r, H + r]

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        self.markov_w1.weight.normal_(0.0, std)
        self.markov_w2.weight.normal_(0.0, std)
        if self.gate_proj is not None:  # every gate starts at sigmoid(~0) = 1/2
            self.gate_proj.weight.normal_(0.0, std)
            self.gate_proj.bias.zero_()

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(markov_w1, markov_w2, gate weight or None, gate bias or None): `markov_drafts`' arguments."""
        gate = self.gate_proj
        return (self.markov_w1.weight, self.markov_w2.weight,
                None if gate is None else gate.weight, None if gate is None else gate.bias)

    def widen(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """[..., H] hidden states, [...] previous tokens -> [..., H + r] = [h ; code]."""
        code = self.markov_w1(prev_ids).to(hidden.dtype)
        if self.gate_proj is not None:
            code = torch.sigmoid(self.gate_proj(torch.cat([hidden, code], dim=-1))) * code
        return torch.cat([hidden, code], dim=-1)


def build_head(cfg: DrafterConfig) -> MarkovHead | None:
    """The bigram head of a dspark drafter config; None for a DFlash one."""
    if not enabled(cfg):
        return None
    return MarkovHead(cfg.vocab_size, cfg.markov_rank, cfg.hidden_size, cfg.markov_head_type)


def previous_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, labels: torch.Tensor,
                    label_valid: torch.Tensor) -> torch.Tensor:
    """Teacher-forced previous token of every slot: [R, N, B] (slot 0's entry is unused).

    Slot k's previous token is the label of slot k - 1 where that label is valid (the token the
    target commits there, whatever the label source), else the dataset token at a_j + k - 1;
    for k = 1 that is the anchor token itself. input_ids [R, S], anchors [R, N],
    labels/label_valid [R, N, B]."""
    R, S = input_ids.shape
    B = labels.shape[-1]
    pos = (block_label_positions(anchors, B) - 1).clamp(0, S - 1)  # a_j + k - 1: [R, N, B]
    data = torch.gather(input_ids, 1, pos.view(R, -1)).view_as(pos)
    shifted_labels = torch.cat([labels[..., :1], labels[..., :-1]], dim=-1)  # label of slot k - 1
    shifted_valid = torch.cat([torch.zeros_like(label_valid[..., :1]), label_valid[..., :-1]], dim=-1)
    return torch.where(shifted_valid, shifted_labels, data)


# ---- decoding -------------------------------------------------------------------------------------

def markov_bias(prev_ids: torch.Tensor, markov_w1: torch.Tensor, markov_w2: torch.Tensor,
                gate_code_w: torch.Tensor | None = None, gate_from_hidden: torch.Tensor | None = None) -> torch.Tensor:
    """[...] previous tokens -> [..., V] logit bias markov_w2 @ code (weights [V, r], in the
    logits' dtype; inference, one slot at a time): code = markov_w1[prev], gated when
    `gate_code_w` (the gate's code part, [r, r]) is given by sigmoid(`gate_from_hidden` (the
    slot's hidden part of the gate with its bias, [..., r]) + code @ gate_code_w.T). Plain
    tensors, so that the engine's compiled head can take them."""
    code = F.embedding(prev_ids, markov_w1).to(markov_w2.dtype)  # [..., r]
    if gate_code_w is not None:
        code = torch.sigmoid(gate_from_hidden + code @ gate_code_w.T) * code
    return code @ markov_w2.T


@torch.no_grad()
def markov_drafts(hidden: torch.Tensor, anchor_ids: torch.Tensor, lm_head_weight: torch.Tensor,
                  markov_w1: torch.Tensor, markov_w2: torch.Tensor, gate_w: torch.Tensor | None = None,
                  gate_b: torch.Tensor | None = None) -> torch.Tensor:
    """Greedy drafts of slots 1..B-1, left to right: hidden [S, B-1, H] (final normed states of
    slots 1..B-1), anchor_ids [S], the head's weights (MarkovHead.weights) -> drafts [S, B-1]. The
    backbone logits of all slots come from one matmul, and so do the hidden state's part of the
    gates; only the bias ([S, r] -> [S, V] per slot) runs sequentially. Plain tensors: the engine
    compiles this as one function (its `dspark_head`)."""
    base = hidden.to(lm_head_weight.dtype) @ lm_head_weight.T  # [S, B-1, V]
    # cast once, not once a slot (no-ops when the drafter runs in bf16)
    markov_w2 = markov_w2.to(base.dtype)
    gates = gate_code_w = None
    if gate_w is not None:  # the gate's hidden part for every slot at once: [S, B-1, r]
        H = hidden.shape[-1]
        gates = torch.addmm(gate_b.to(base.dtype), hidden.to(base.dtype).flatten(0, 1),
                            gate_w[:, :H].to(base.dtype).T).view(*hidden.shape[:2], -1)
        gate_code_w = gate_w[:, H:].to(base.dtype)
    prev = anchor_ids
    drafts = []
    for k in range(base.shape[1]):
        bias = markov_bias(prev, markov_w1, markov_w2, gate_code_w, None if gates is None else gates[:, k])
        prev = (base[:, k] + bias).argmax(-1)  # [S]
        drafts.append(prev)
    return torch.stack(drafts, dim=1)


def draft_head(x: torch.Tensor, norm_w: torch.Tensor, lm_head_w: torch.Tensor, anchors: torch.Tensor,
               markov_w1: torch.Tensor, markov_w2: torch.Tensor, gate_w: torch.Tensor | None,
               gate_b: torch.Tensor | None, *, eps: float) -> torch.Tensor:
    """The static speculative engine's head (speculative/static_drafter.py) for a dspark drafter:
    the block's residual stream x [S, B, H], final-normed as the drafter's RMSNorm does, drafted
    left to right from anchors [S] -> drafts [S, B-1] (the gate's weights None for the vanilla head)."""
    hidden = rms_norm(x[:, 1:], norm_w, eps, scale_in_float32=True)  # [S, B-1, H]
    return markov_drafts(hidden, anchors, lm_head_w, markov_w1, markov_w2, gate_w, gate_b)


# ---- checkpoint (docs/dflash-spec.md, "Variant: dspark", Checkpoint) ------------------------------
# DFlash's directory (drafter/checkpoint.py) plus the fields below and the head's tensors,
# `markov_head.markov_w{1,2}.weight` ([V, r] each): vLLM's Qwen3 DSpark drafter's layout. The gated
# head adds `markov_head.gate_proj.{weight,bias}` ([r, H + r], [r]) under `markov_head_type: "gated"`,
# the names of DeepSeek's DeepSpec trainer (vLLM loads the vanilla head).

def add_checkpoint_fields(out: dict, cfg: DrafterConfig) -> None:
    """A dspark drafter's config.json (`out`, DFlash's) in the layout vLLM's Qwen3 DSpark drafter
    reads: its architecture, the bigram head's rank and kind, and `sample_from_anchor: false` (slot 0
    is the anchor and slots 1..B-1 are drafted, DFlash's block; vLLM's own default drafts from the
    anchor slot). Nothing for a DFlash drafter."""
    if not enabled(cfg):
        return
    out["architectures"] = [ARCHITECTURE]
    fields = {"projector_type": PROJECTOR_TYPE, "markov_rank": cfg.markov_rank,
              "markov_head_type": cfg.markov_head_type, "sample_from_anchor": False}
    # dspark_bonus_anchor: the same block layout under the name other vLLM builds read
    out.update(fields, draft_vocab_size=cfg.vocab_size, dspark_bonus_anchor=True)
    out["dflash_config"].update(fields)


def fields_from_checkpoint(data: dict) -> dict[str, Any]:
    """The DrafterConfig fields `variant`, `markov_rank` and `markov_head_type` of a config.json
    (`data`), each read from its `dflash_config` first, then its top level; a DFlash drafter's
    defaults where it names no dspark projector."""
    dflash = data.get("dflash_config") or {}

    def read(key: str, default: Any) -> Any:
        return dflash.get(key, data.get(key, default))

    return {"variant": VARIANT if read("projector_type", None) == PROJECTOR_TYPE else "dflash",
            "markov_rank": int(read("markov_rank", DEFAULT_RANK)),
            "markov_head_type": read("markov_head_type", "vanilla")}


def check_checkpoint(data: dict, path: Path) -> None:
    """ModelError where the config.json `data` (at `path`) is a DSpark drafter this project cannot
    load: an unknown head type, or a block that drafts from the anchor slot (sample_from_anchor)."""
    if ARCHITECTURE not in data["architectures"]:
        return
    if data.get("markov_head_type", "vanilla") not in HEAD_TYPES:
        raise ModelError(f"{path}: markov_head_type {data['markov_head_type']!r} is not supported "
                         f"(one of {list(HEAD_TYPES)})")
    if data.get("sample_from_anchor", True):
        raise ModelError(f"{path}: a DSpark drafter that drafts from the anchor slot (sample_from_anchor) "
                         "is not this project's block layout (sample_from_anchor: false)")


def grow(saved: DrafterConfig, config: DrafterConfig) -> tuple[DrafterConfig, list[str]]:
    """(`saved` with the bigram head `config` adds to it, what that adds) when `saved` is a DFlash
    drafter and `config` a dspark one (drafter.init_from); (`saved`, []) otherwise."""
    if enabled(saved) or not enabled(config):
        return saved, []
    grown = dataclasses.replace(saved, variant=VARIANT, markov_rank=config.markov_rank,
                                markov_head_type=config.markov_head_type)
    return grown, [f"the dspark bigram head ({config.markov_head_type}, rank {config.markov_rank}, markov_w2 zero)"]


@torch.no_grad()
def silence_new_head(grown: DFlashDrafter, saved: DFlashDrafter) -> None:
    """markov_w2 zero where `grown` has the bigram head and `saved` has none: the head's bias is then
    zero, and the grown drafter drafts as the saved one until trained (markov_w1 and the gate stay
    random: markov_w2's first gradients need them)."""
    if grown.markov_head is not None and saved.markov_head is None:
        grown.markov_head.markov_w2.weight.zero_()
