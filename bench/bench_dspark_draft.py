"""Drafting cost of one speculative round: a dspark drafter (drafter/dspark.py) against the DFlash
drafter with the same backbone, on the static engine's drafter (speculative/static_drafter.py).

    # on a GPU, a target directory or a preset of real shapes (random weights):
    python bench/bench_dspark_draft.py preset:qwen3-8b --slots 1 8 64 --out runs/bench_dspark_draft.json
    # CPU smoke check of the script itself:
    python bench/bench_dspark_draft.py preset:tiny --device cpu --slots 1 4 --repeats 5

Measured per round, warm-up excluded: `propose` (the block forward over the drafter's cache and
the drafts) for each variant, and the part of it after the backbone (the head): DFlash's one
argmax over slots 1..B-1 against dspark's B-1 sequential bias-and-argmax steps, with the vanilla
head and the gated one (`gated`). The backbone weights are the same in all (same seed), so the
difference is the bigram head alone. No CUDA
graphs here: on a GPU the sequential head's B-1 small launches are its main cost, which a
captured round (the engine's default) mostly removes; bench_spec_decode.py measures that.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_train.drafter.config import drafter_config_from_target
from dflash_train.drafter.dspark import markov_drafts
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.speculative.static_drafter import StaticDrafter, _draft_head, _norm
from dflash_train.target.loading import load_target_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", help="Hugging Face model directory or preset:NAME (random weights)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=5, help="drafter decoder layers")
    p.add_argument("--markov-rank", type=int, default=256)
    p.add_argument("--slots", type=int, nargs="+", default=[1, 8, 64], help="batch sizes (sequences per round)")
    p.add_argument("--context", type=int, default=512, help="committed tokens per sequence")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


def drafters(model, args, device, dtype) -> dict[str, DFlashDrafter]:
    """DFlash and dspark with each head, with identical backbones (the bigram head is built and drawn last)."""
    rows = model.get_input_embeddings().weight.shape[0]
    out = {}
    for name, variant, head in (("dflash", "dflash", "vanilla"), ("dspark", "dspark", "vanilla"),
                                ("gated", "dspark", "gated")):
        cfg = drafter_config_from_target(model.config, mask_token_id=rows - 1, block_size=args.block_size,
                                         num_hidden_layers=args.layers, variant=variant,
                                         markov_rank=args.markov_rank, markov_head_type=head)
        torch.manual_seed(0)
        out[name] = DFlashDrafter(cfg).to(device=device, dtype=dtype).eval()
    return out


def timed(fn, repeats: int, device: torch.device) -> float:
    """Mean milliseconds of fn() over `repeats` calls, after two warm-up calls."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / repeats


@torch.no_grad()
def measure(model, drafter: DFlashDrafter, slots: int, args, device) -> dict[str, float]:
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    lm = head.weight if head is not None else embed
    B, ctx = args.block_size, args.context
    static = StaticDrafter(drafter, embed, lm, slots, ctx + B)
    taps = torch.randn(slots, ctx, drafter.config.num_taps * drafter.config.hidden_size, device=device,
                       dtype=static.dtype)
    rows = torch.arange(slots, device=device)
    static.start(torch.zeros(slots, ctx, dtype=torch.long, device=device), torch.full_like(rows, ctx), rows, taps)
    tokens = torch.randint(0, embed.shape[0] - 1, (slots,), device=device)
    positions = torch.full_like(rows, ctx)
    x = static._block_residual(tokens, positions, ctx + B)
    if drafter.markov_head is None:
        def head_only():
            return _draft_head(x, static.norm_w, lm, eps=static.norm_eps)
    else:
        def head_only():
            return markov_drafts(_norm(x[:, 1:], static.norm_w, static.norm_eps), tokens, lm,
                                 *drafter.markov_head.weights())
    # the head timed alone is the one propose() runs: the same drafts
    same = bool(torch.equal(head_only(), static.propose(tokens, positions, ctx + B)))
    return {"propose_ms": timed(lambda: static.propose(tokens, positions, ctx + B), args.repeats, device),
            "head_ms": timed(head_only, args.repeats, device), "head_drafts_as_propose": same}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_target_model(args.target, dtype=dtype, device=device)
    results = {"target": args.target, "device": str(device), "block_size": args.block_size,
               "markov_rank": args.markov_rank, "layers": args.layers, "context": args.context, "rounds": []}
    for variant, drafter in drafters(model, args, device, dtype).items():
        for slots in args.slots:
            row = {"variant": variant, "slots": slots, **measure(model, drafter, slots, args, device)}
            results["rounds"].append(row)
            print(f"{variant:6s} slots {slots:4d}: propose {row['propose_ms']:8.3f} ms/round, "
                  f"head {row['head_ms']:8.3f} ms", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return results


if __name__ == "__main__":
    main()
