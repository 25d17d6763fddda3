"""Speculative decoding through the generic Hugging Face path (speculative/loop.py) on real-shaped
random targets whose caches it must roll back (sliding-window Gemma 3; hybrid linear-attention
Qwen3.5, whose recurrent layers that path replays): lossless under forced partial acceptance, and
what rolling their caches back costs.

A randomly initialised drafter accepts nothing and so proves nothing about rollback; an oracle
proposer does: it offers the target's own greedy continuation with every round's drafts
corrupted from a slot on (accepting 0, 1, ... B-1 in turn), so each round rolls the cache back
by a different amount. Prompts are random token ids longer than the sliding window. Per
family it reports: outputs equal to plain greedy (the same loop with no drafts) and to
transformers' own `generate`, the rounds, the replay forwards the recurrent layers needed and
their share of verify time, greedy and speculative tok/s.

    python bench/family_eval.py --families gemma3-27b qwen3.5-27b --dtype float32 --out family_eval.json
    python bench/family_eval.py --families tiny-gemma3 tiny-qwen3.5 --device cpu   # the plumbing, on a CPU
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dflash_train.speculative.loop import SpeculativeDecoder
from dflash_train.utils.device import resolve_device

SHAPES: dict[str, dict] = {
    # Gemma-3-27B's text stack: 5 sliding-window (1,024) layers to 1 global
    "gemma3-27b": dict(model_type="gemma3_text", hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                       num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
                       sliding_window=1024, vocab_size=262208, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 10 + ["sliding_attention"] * 2),
    # Qwen3.5-27B's text stack: 3 gated-delta-net (linear attention) layers to 1 full-attention layer
    "qwen3.5-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
                        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
                        linear_conv_kernel_dim=4, vocab_size=248320, rms_norm_eps=1e-6,
                        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16),
    "tiny-gemma3": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                        sliding_window=16, vocab_size=512, layer_types=["sliding_attention", "full_attention"] * 2),
    "tiny-qwen3.5": dict(model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         vocab_size=512, layer_types=["linear_attention"] * 3 + ["full_attention"]),
}


class OracleProposer:
    """Drafts the target's greedy continuation `reference`, correct for the first `correct[r % n]`
    slots of round r and wrong after that."""

    def __init__(self, reference: list[int], prompt_len: int, block_size: int, vocab: int):
        self.reference, self.prompt_len, self.block_size, self.vocab = reference, prompt_len, block_size, vocab
        self.correct = list(range(block_size))  # 0, 1, ..., B-1 drafts accepted in turn
        self.round = 0

    def start(self) -> None:
        self.round = 0

    def extend(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        pass

    def propose(self, sequence, position: int) -> list[int]:
        done = len(sequence) - self.prompt_len
        good = self.correct[self.round % len(self.correct)]
        self.round += 1
        truth = self.reference[done:done + self.block_size - 1]
        truth += [0] * (self.block_size - 1 - len(truth))
        return [t if k < good else (t + 1) % self.vocab for k, t in enumerate(truth)]


def build_target(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """The family's model at its real shape with transformers' own random init, made on `device`."""
    kwargs = dict(SHAPES[name])
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.eval().requires_grad_(False)


def measure(name: str, args, device: torch.device) -> dict:
    dtype = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    model = build_target(name, dtype, device)
    built = time.perf_counter() - t0
    vocab = model.config.get_text_config().vocab_size
    window = getattr(model.config, "sliding_window", None) or 0
    prompt_len = max(args.prompt_len, window + 8)  # the prefill alone fills every window
    gen = torch.Generator().manual_seed(1)
    layers = [1, model.config.num_hidden_layers // 2]
    out = {"family": name, "dtype": args.dtype, "prompt_tokens": prompt_len, "new_tokens": args.new_tokens,
           "build_seconds": built, "prompts": []}
    with SpeculativeDecoder(model, layers, set()) as decoder:
        for p in range(args.prompts):
            prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
            greedy = decoder.generate(prompt, args.new_tokens)
            oracle = OracleProposer(greedy.tokens, prompt_len, args.block_size, vocab)
            spec = decoder.generate(prompt, args.new_tokens, oracle)
            row = {"equal_to_greedy": spec.tokens == greedy.tokens, "rounds": len(spec.rounds),
                   "accepted": sum(r.accepted for r in spec.rounds), "greedy_tok_per_s": len(greedy.tokens) / greedy.seconds,
                   "spec_tok_per_s": len(spec.tokens) / spec.seconds, "verify_seconds": spec.verify_seconds,
                   "replays": spec.replay.replays if spec.replay else 0,
                   "replayed_tokens": spec.replay.replayed_tokens if spec.replay else 0,
                   "replay_seconds": spec.replay.seconds if spec.replay else 0.0}
            if p == 0 and args.check_generate:
                ids = torch.tensor([prompt], device=device)
                ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)[0, prompt_len:].tolist()
                row["equal_to_transformers_generate"] = ref == greedy.tokens
            out["prompts"].append(row)
            print(name, json.dumps(row), flush=True)
    out["lossless"] = all(r["equal_to_greedy"] and r.get("equal_to_transformers_generate", True) for r in out["prompts"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=["gemma3-27b", "qwen3.5-27b"], choices=sorted(SHAPES))
    ap.add_argument("--dtype", default="float32", help="float32: exact comparisons (random weights' logits are close)")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--check-generate", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = resolve_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32: the comparison is exact arithmetic's
    results = []
    for name in args.families:
        results.append(measure(name, args, device))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "lossless_families": sum(r["lossless"] for r in results), "results": results}
    print(json.dumps({r["family"]: r["lossless"] for r in results}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
