"""Turn a Model-Optimizer DFlash export into a dflash-train drafter checkpoint.

    python bench/peer_modelopt/convert.py PEER_EXPORT_DIR OUT_DIR [--dtype bfloat16|float32]

Model-Optimizer (`nvidia-modelopt`, `export_speculative_decoding`) writes the drafter as
`config.json` + `model.safetensors` with the tensor names of docs/dflash-spec.md. The names
alone prove little, so this checks the semantics that decide what the drafter computes,
against what our DFlashDrafter does (checked numerically by tests/bench/test_peer_modelopt_convert.py):

* taps: `dflash_config.target_layer_ids`, concatenated in that order before `fc`; both take
  the output of decoder layer l (Hugging Face `hidden_states[l + 1]`);
* block attention: `dflash_config.causal` (false = bidirectional) -> causal_in_block_*;
  sliding windows (`use_swa` / `swa_window_size`: every layer windows the context, not
  the block) -> every layer "sliding_attention" with that window;
* RoPE: plain RoPE with `rope_theta` (the peer trains without rope scaling; an export
  with `rope_scaling` set has it added for serving only, which we refuse rather than guess);
* `rms_norm_eps`, head shapes, MLP width and the mask token as written;
* what we cannot express is refused with one line: attention sinks, Domino/DSpark heads,
  attention biases, an activation other than SiLU.

With the launcher's `peer_run.json` beside the export (train_peer.py writes it) the RoPE
base the drafter really trained with is checked against the exported one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dflash_train.drafter.checkpoint import save_drafter
from dflash_train.drafter.config import FULL, SLIDING, DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.utils.errors import ModelError

RUN_RECORD = "peer_run.json"  # written by train_peer.py beside the export


def _refuse_unsupported(cfg: dict, where: Path) -> None:
    dflash = cfg.get("dflash_config") or {}
    problems = []
    if dflash.get("attention_sink_bias") or cfg.get("attention_sink_bias"):
        problems.append("attention sinks (dflash_attention_sink) have no equivalent in DFlashDrafter")
    if dflash.get("projector_type") not in (None, "dflash"):
        problems.append(f"projector_type {dflash['projector_type']!r} adds a head DFlashDrafter does not have")
    if cfg.get("attention_bias"):
        problems.append("attention_bias=true: DFlashDrafter's projections have no bias")
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act {cfg['hidden_act']!r}: DFlashDrafter's MLP is SwiGLU (silu)")
    if FULL not in set(cfg.get("layer_types") or [FULL]) or len(set(cfg.get("layer_types") or [FULL])) > 1:
        problems.append(f"layer_types {cfg.get('layer_types')}: the peer's per-layer sliding windows go to an "
                        "attention kernel that may ignore them; only its mask window (use_swa) is converted")
    if cfg.get("rope_scaling"):
        problems.append("rope_scaling is set: the peer trains with plain RoPE and adds scaling for serving "
                        "only (dflash_export_rope_scaling); export without it")
    if problems:
        raise ModelError(f"{where}: cannot convert: " + "; ".join(problems))


def peer_drafter_config(cfg: dict, where: Path = Path("config.json")) -> DrafterConfig:
    """Our DrafterConfig for a Model-Optimizer DFlash export's config.json (a dict)."""
    if "DFlashDraftModel" not in (cfg.get("architectures") or []):
        raise ModelError(f"{where}: architectures is {cfg.get('architectures')}, expected DFlashDraftModel")
    _refuse_unsupported(cfg, where)
    dflash = cfg.get("dflash_config") or {}
    causal = bool(dflash.get("causal", False))  # the peer's default is bidirectional within the block
    n = int(cfg["num_hidden_layers"])
    window = dflash.get("swa_window_size") if dflash.get("use_swa") else None
    try:
        return DrafterConfig(
            hidden_size=int(cfg["hidden_size"]),
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg["num_key_value_heads"]),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
            num_target_layers=int(cfg["num_target_layers"]),
            mask_token_id=int(dflash["mask_token_id"]),
            num_hidden_layers=n,
            block_size=int(cfg["block_size"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            rope_theta=float(cfg["rope_theta"]),
            rope_scaling=None,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 32768),
            layer_types=[SLIDING if window else FULL] * n,
            sliding_window=int(window) if window else None,
            # one rule for every layer in the peer: the same flag for both kinds
            causal_in_block_full=causal,
            causal_in_block_sliding=causal,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelError(f"{where}: not a usable DFlash config ({type(exc).__name__}: {exc})") from None


def _check_run_record(peer_dir: Path, cfg: DrafterConfig) -> None:
    record_path = peer_dir / RUN_RECORD
    if not record_path.is_file():
        return
    record = json.loads(record_path.read_text())
    trained = record.get("draft_rope_theta")
    if trained is not None and float(trained) != cfg.rope_theta:
        raise ModelError(f"{record_path}: the drafter trained with rope_theta {trained} but the export says "
                         f"{cfg.rope_theta}: the converted drafter would place its context wrongly")


def load_peer_drafter(peer_dir: str | Path) -> DFlashDrafter:
    """DFlashDrafter holding the weights of a Model-Optimizer export directory (float32)."""
    peer_dir = Path(peer_dir)
    cfg_path, weights_path = peer_dir / "config.json", peer_dir / "model.safetensors"
    for path in (cfg_path, weights_path):
        if not path.is_file():
            raise ModelError(f"{path} is missing: not a Model-Optimizer DFlash export")
    try:
        raw = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{cfg_path}: not valid JSON ({exc})") from None
    cfg = peer_drafter_config(raw, cfg_path)
    _check_run_record(peer_dir, cfg)
    try:
        state = load_file(str(weights_path))
    except (OSError, SafetensorError) as exc:
        raise ModelError(f"{weights_path}: cannot read the weights ({exc})") from None
    # the peer's prefix for a raw training checkpoint; rotary buffers are recomputed
    state = {k.split("dflash_module.", 1)[-1]: v for k, v in state.items() if "rotary_emb" not in k}
    model = DFlashDrafter(cfg)
    expected = model.state_dict()
    wrong = [f"{k}: {tuple(v.shape)} vs {tuple(expected[k].shape)}" for k, v in state.items()
             if k in expected and v.shape != expected[k].shape]
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if wrong or missing or unexpected:
        raise ModelError(f"{weights_path}: does not match its config: shapes {wrong}, missing {missing}, "
                         f"unexpected {unexpected}")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model


def convert(peer_dir: str | Path, out_dir: str | Path, *, dtype: torch.dtype | None = None) -> Path:
    """Write our checkpoint (config.json + model.safetensors) for the export in `peer_dir`.
    `dtype` None keeps the export's weight dtype."""
    peer_dir = Path(peer_dir)
    model = load_peer_drafter(peer_dir)
    if dtype is None:
        first = next(iter(load_file(str(peer_dir / "model.safetensors")).values()))
        dtype = first.dtype
    return save_drafter(model, out_dir, dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("peer_export", help="directory with the peer's config.json + model.safetensors")
    p.add_argument("output", help="directory to write our drafter checkpoint to (must not exist)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="weight dtype written (auto: the export's)")
    args = p.parse_args(argv)
    if Path(args.output).exists():
        print(f"error: {args.output} exists; choose a new directory", file=sys.stderr)
        return 2
    try:
        out = convert(args.peer_export, args.output,
                      dtype=None if args.dtype == "auto" else getattr(torch, args.dtype))
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"converted {args.peer_export} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
