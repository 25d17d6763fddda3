"""Starting drafter decoder layers as copies of target decoder layers (`drafter.init_from_target`).

A drafter layer (drafter/model.py) is a Qwen3 decoder layer with the target's hidden size and
head layout: q/k/v/o projections, per-head q/k RMSNorms, a SiLU-gated MLP and two RMSNorms.
Each of those tensors has a true counterpart in a Llama/Qwen-style target layer of the same
name, and is copied from it:

    drafter layer i                         target layer ids[i] (Hugging Face names)
    self_attn.{q,k,v,o}_proj.weight     <-  self_attn.{q,k,v,o}_proj.weight
                                            (Phi-3: rows [h*d | g*d | g*d] of self_attn.qkv_proj.weight)
    self_attn.{q,k}_norm.weight         <-  the same names (Qwen3); absent in Llama: kept at 1
    mlp.{gate,up,down}_proj.weight      <-  the same names (Phi-3: halves [gate | up] of mlp.gate_up_proj.weight)
    input_layernorm.weight, post_attention_layernorm.weight  <-  the same names

The drafter's k/v projections also embed the injected context (the fc projection of the
tapped target states, drafter/model.py), which no target layer does: the copied k/v see it
as if it were a hidden state of that layer. `fc`, `hidden_norm` and the output `norm` have
no counterpart in a decoder layer and keep their own start (the output norm is calibrated
to the LM head in train/setup.py). The drafter owns no embedding or LM head: it uses the
target's, frozen, so there is nothing to copy there.

Target tensors without a drafter counterpart (biases of Qwen2's q/k/v) are left out and
reported; a shape that differs (e.g. drafter.intermediate_size set to another width) is an
error naming the tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter

# Model families whose decoder layers are the drafter's up to naming: pre-norm, RMSNorm scaling
# by its weight (not Gemma's 1 + weight), SiLU-gated MLP, no extra norms around attention/MLP.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "smollm3", "seed_oss")

LINEARS = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
           "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
LAYER_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")  # Qwen3 only
FUSED_QKV = "self_attn.qkv_proj.weight"
FUSED_GATE_UP = "mlp.gate_up_proj.weight"


def check_target_layers_copyable(text_config: Any) -> None:
    """ValueError unless the target's decoder layers have the drafter's structure (model type, activation)."""
    model_type = getattr(text_config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"copying decoder layers is supported for targets of model type "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)} (the drafter's layer structure), not {model_type!r}")
    act = getattr(text_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"the target's MLP activation is {act!r}; the drafter's is silu")


def drafter_tensors_of_target_layer(state: dict[str, torch.Tensor],
                                    cfg: DrafterConfig) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A target layer's tensors (names relative to the layer) -> (drafter layer name -> tensor, target
    names left out). Fused Phi-3 projections are split; nothing is copied or cast here."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name in LINEARS + LAYER_NORMS + QK_NORMS:
        if name in state:
            out[name] = state[name]
            used.add(name)
    h, g, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if FUSED_QKV in state:
        qkv = state[FUSED_QKV]
        if qkv.dim() != 2 or qkv.shape[0] != (h + 2 * g) * d:
            raise ValueError(f"target tensor {FUSED_QKV} has shape {list(qkv.shape)}; the drafter's q, k, v "
                             f"({h}, {g}, {g} heads of {d}) need {(h + 2 * g) * d} rows")
        q, k, v = torch.split(qkv, [h * d, g * d, g * d], dim=0)
        out.update({"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v})
        used.add(FUSED_QKV)
    if FUSED_GATE_UP in state:
        gate_up = state[FUSED_GATE_UP]
        if gate_up.dim() != 2 or gate_up.shape[0] % 2:
            raise ValueError(f"target tensor {FUSED_GATE_UP} has shape {list(gate_up.shape)}: not two halves")
        gate, up = gate_up.chunk(2, dim=0)  # Phi3MLP: gate, up = gate_up_proj(x).chunk(2, dim=-1)
        out.update({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up})
        used.add(FUSED_GATE_UP)
    missing = [n for n in LINEARS + LAYER_NORMS if n not in out]
    if missing:
        raise ValueError(f"the target layer has no tensor for the drafter's {', '.join(missing)} "
                         f"(its tensors: {', '.join(sorted(state))})")
    return out, sorted(set(state) - used)


@dataclass
class LayerCopyReport:
    source_layers: list[int]
    copied: list[str] = field(default_factory=list)  # drafter layer tensor names (relative), copied in every layer
    kept: list[str] = field(default_factory=list)  # drafter layer tensors with no counterpart: own init
    left_out: list[str] = field(default_factory=list)  # target layer tensors with no drafter counterpart


@torch.no_grad()
def copy_target_layers(drafter: DFlashDrafter, source_layers: list[int],
                       target_layers: dict[int, dict[str, torch.Tensor]]) -> LayerCopyReport:
    """Drafter layer i <- target layer source_layers[i] (its tensors in `target_layers`, names relative
    to the layer). Values are cast to the drafter's dtype and device. Everything is checked before
    anything is written: a ValueError names the drafter layer, target layer and tensor."""
    cfg = drafter.config
    if len(source_layers) != len(drafter.layers):
        raise ValueError(f"{len(source_layers)} source layers for {len(drafter.layers)} drafter layers")
    plan = []
    report = LayerCopyReport(list(source_layers))
    for i, (layer, src) in enumerate(zip(drafter.layers, source_layers, strict=True)):
        if src not in target_layers:
            raise ValueError(f"target layer {src} was not loaded")
        try:
            mapped, left_out = drafter_tensors_of_target_layer(target_layers[src], cfg)
        except ValueError as exc:
            raise ValueError(f"drafter layer {i} <- target layer {src}: {exc}") from None
        params = dict(layer.named_parameters())
        for name, value in mapped.items():
            if tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(f"drafter layer {i} <- target layer {src}: tensor {name} has shape "
                                 f"{list(value.shape)} in the target, {list(params[name].shape)} in the drafter")
            plan.append((params[name], value))
        if i == 0:
            report.copied = sorted(mapped)
            report.kept = sorted(set(params) - set(mapped))
            report.left_out = left_out
    for param, value in plan:
        param.copy_(value.to(device=param.device, dtype=param.dtype))
    return report
