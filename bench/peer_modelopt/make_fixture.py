"""Write tests/fixtures/peer_modelopt/: what Model-Optimizer's own DFlash code computes on a tiny
seeded Llama, for tests/bench/test_peer_modelopt_convert.py (which runs without modelopt).

    PYTHONPATH=<peer site>:src python bench/peer_modelopt/make_fixture.py [OUT_DIR]

Needs nvidia-modelopt (peer_setup.PEER_PACKAGE) and runs on the CPU in float32. It
1. builds a random Llama (8 layers, hidden 16, rope theta 5000, rms eps 1e-5) and saves it
   as a Hugging Face folder (`target/`);
2. converts it with mtsp.convert to a DFlash model (5 layers, block 8, taps [1..5] = our
   default_target_layer_ids(8)), then scales the drafter's weights up (seeded) so every
   tensor, norms included, moves the output;
3. exports the drafter with the peer's exporter (`export/`: the layout convert.py reads);
4. runs the peer's drafter twice and saves inputs and outputs (`io.safetensors`):
   * inference: `pseudo_speculative_generate` on a prompt (the peer's own tap selection,
     block [anchor, MASK...] at positions P.., no mask), with the drafter's output hidden
     states caught by a forward hook and turned into logits with the target's lm_head;
   * training: one training forward on a 32-token row (4 anchors, drawn by the peer),
     catching the anchors it drew and the drafter's output hidden states.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from peer_setup import convert_to_peer_dflash, dflash_settings, draft_rope_theta, stub_missing_pulp

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "peer_modelopt"
BLOCK, ANCHORS, MASK_ID = 8, 4, 63
TAPS = [1, 2, 3, 4, 5]


def tiny_target(path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=8, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, vocab_size=64, max_position_embeddings=128,
                      tie_word_embeddings=True, rope_theta=5000.0, rms_norm_eps=1e-5, initializer_range=0.2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def scramble_drafter(module: torch.nn.Module) -> None:
    """Weights far from init (norm weights away from 1), so any mismatch shows in the output."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.3 * noise if p.dim() == 1 else 0.25 * noise)


def run_inference(model, prompt: torch.Tensor) -> dict:
    caught = {}
    hook = model.dflash_module.register_forward_hook(lambda m, a, out: caught.update(hidden=out))
    model.eval()
    with torch.no_grad():
        base_token, drafts = model.pseudo_speculative_generate(prompt, steps=BLOCK - 1)
        logits = model.lm_head(caught["hidden"][:, 1:])
    hook.remove()
    return {"prompt_ids": prompt, "base_token": base_token, "draft_tokens": drafts, "draft_logits": logits}


def run_training_forward(model, row: torch.Tensor, labels: torch.Tensor) -> dict:
    caught = {}
    sample = model._sample_anchor_positions

    def sample_and_keep(*args, **kwargs):
        caught["anchors"], caught["keep"] = sample(*args, **kwargs)
        return caught["anchors"], caught["keep"]

    model._sample_anchor_positions = sample_and_keep
    hook = model.dflash_module.register_forward_hook(lambda m, a, out: caught.update(hidden=out))
    model.train()
    torch.manual_seed(2)
    with torch.no_grad():
        out = model(input_ids=row, attention_mask=torch.ones_like(row), labels=labels)
    hook.remove()
    del model._sample_anchor_positions
    if not bool(caught["keep"].all()):
        raise RuntimeError("every fixture anchor must be valid (the peer and we treat invalid ones differently)")
    return {"train_ids": row, "train_labels": labels, "train_anchors": caught["anchors"],
            "train_hidden": caught["hidden"], "train_loss": out.loss.detach().reshape(1)}


def main(out: Path = FIXTURE) -> None:
    stub_missing_pulp()
    from modelopt.torch.export import export_speculative_decoding

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    torch.manual_seed(0)
    model = tiny_target(out / "target")
    settings = dflash_settings(model.config, mask_token_id=MASK_ID, block_size=BLOCK, num_layers=5,
                               target_layer_ids=TAPS, num_anchors=ANCHORS)
    convert_to_peer_dflash(model, settings)
    scramble_drafter(model.dflash_module)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 60, (1, 12), generator=gen)
    row = torch.randint(0, 60, (1, 32), generator=gen)
    labels = row.clone()
    labels[:, :9] = -100  # a prompt the drafter is not trained on
    io = {**run_inference(model, prompt), **run_training_forward(model, row, labels)}
    model.eval()
    with torch.inference_mode():
        export_speculative_decoding(model, export_dir=str(out / "export"))
    save_file({k: v.contiguous() for k, v in io.items()}, str(out / "io.safetensors"))
    meta = {"made_by": "bench/peer_modelopt/make_fixture.py", "peer": __import__("modelopt").__version__,
            "transformers": __import__("transformers").__version__, "torch": torch.__version__,
            "draft_rope_theta": draft_rope_theta(model), "block_size": BLOCK, "target_layer_ids": TAPS,
            "mask_token_id": MASK_ID, "train_loss": float(io["train_loss"])}
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"fixture written to {out} ({size} bytes): {json.dumps(meta)}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE)
