"""Building Model-Optimizer's DFlash drafter on a Hugging Face target, through its public API
(`modelopt.torch.speculative.convert`), with the settings that make it comparable to ours.

Shared by train_peer.py and make_fixture.py. Three things the peer's package needs here,
all done from the outside (no file of the peer is changed):

* `pulp` (a 16 MB wheel with LP-solver binaries) is imported at module level by
  `modelopt.torch.opt.searcher`, which the conversion path imports but DFlash never uses.
  When it is not installed a placeholder module stands in; using it raises ImportError.
* The drafter's rotary embedding is created lazily with `Qwen3RotaryEmbedding(config, device=...)`;
  transformers >= 5.18 dropped that argument. It is created here, right after conversion,
  so the lazy path never runs (same class, same config).
* Under transformers 5 the target's rope theta is not copied into the drafter's config (the
  peer looks for a `rope_theta` attribute, which lives in `rope_parameters` now) and the
  drafter's head sizes, MLP width and norm eps default to Qwen3's, not the target's. All of
  them are passed explicitly and checked after conversion.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

# The peer's DFlash plugin warns outside transformers 4.57-5.14; it runs on 5.17 and 5.24.
PEER_PACKAGE = "nvidia-modelopt==0.47.0"


def stub_missing_pulp() -> bool:
    """Put a placeholder `pulp` module in place when the real one is absent; True if it did."""
    if "pulp" in sys.modules or importlib.util.find_spec("pulp") is not None:
        return False
    module = types.ModuleType("pulp")

    class _Missing:  # annotations in modelopt.torch.opt.searcher name pulp classes at import time
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError("pulp is not installed (only Model-Optimizer's NAS searcher needs it)")

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing

    module.__getattr__ = __getattr__  # type: ignore[attr-defined]
    sys.modules["pulp"] = module
    return True


def rope_theta_of(text_cfg: Any) -> float:
    from dflash_train.drafter.config import rope_settings_of

    theta, scaling = rope_settings_of(text_cfg)
    if scaling:
        raise ValueError(f"the target uses rope scaling {scaling}: the peer's drafter has plain RoPE only")
    return theta


def dflash_settings(text_cfg: Any, *, mask_token_id: int, block_size: int, num_layers: int,
                    target_layer_ids: list[int], num_anchors: int) -> dict:
    """The `dflash` mode config for mtsp.convert: our drafter's shape on this target."""
    theta = rope_theta_of(text_cfg)
    heads = int(text_cfg.num_attention_heads)
    arch = {
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(text_cfg, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // heads),
        "intermediate_size": int(text_cfg.intermediate_size),
        "rms_norm_eps": float(text_cfg.rms_norm_eps),
        "max_position_embeddings": int(text_cfg.max_position_embeddings),
        "rope_theta": theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "target_layer_ids": list(target_layer_ids),
    }
    return {
        "dflash_block_size": block_size,
        "dflash_mask_token_id": mask_token_id,
        "dflash_num_anchors": num_anchors,
        "dflash_architecture_config": arch,
        # the peer's defaults, written out: KD from the target's logits, D-PACE weights
        "dflash_self_logit_distillation": True,
        "dflash_loss_objective": "dpace",
        "dflash_draft_attention": "bidirectional",
    }


def convert_to_peer_dflash(model: Any, settings: dict) -> Any:
    """mtsp.convert(model, dflash) in place; returns the model with its drafter ready to run."""
    stub_missing_pulp()
    import modelopt.torch.speculative as mtsp
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    mtsp.convert(model, [("dflash", settings)])
    draft_cfg = model.dflash_config
    arch = settings["dflash_architecture_config"]
    got_theta = float(draft_cfg.rope_parameters["rope_theta"])
    if got_theta != arch["rope_theta"]:
        raise RuntimeError(f"the peer's drafter got rope_theta {got_theta}, expected the target's {arch['rope_theta']}")
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps"):
        if getattr(draft_cfg, key) != arch[key]:
            raise RuntimeError(f"the peer's drafter has {key}={getattr(draft_cfg, key)}, expected {arch[key]}")
    if list(model.target_layer_ids) != list(arch["target_layer_ids"]):
        raise RuntimeError(f"the peer taps {model.target_layer_ids}, expected {arch['target_layer_ids']}")
    module = model.dflash_module
    device = next(module.parameters()).device
    module.rotary_emb = Qwen3RotaryEmbedding(config=draft_cfg).to(device)
    return model


def draft_rope_theta(model: Any) -> float:
    """The RoPE base the peer's drafter computes with (its rotary embedding's config)."""
    return float(model.dflash_module.rotary_emb.config.rope_parameters["rope_theta"])
