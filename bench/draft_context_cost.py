"""Draft time per speculative round against the context's length, with and without a window.

    # on a GPU: the SmolLM2-shaped target and drafter (random weights: time depends on shapes),
    # its full-attention drafter as it is (0) and decoded with a 2,048-token window
    python bench/draft_context_cost.py preset:smollm2-135m --draft-windows 0 2048 \\
        --contexts 256 1024 4096 16384 --out runs/draft_context_cost.json
    # an exported drafter (its own layer types; 0 = as trained)
    python bench/draft_context_cost.py TARGET_DIR --drafter DRAFTER_DIR --draft-windows 0 2048 --out d.json
    # CPU smoke check of the script itself (tiny target, a drafter with a window of 64):
    python bench/draft_context_cost.py preset:tiny --sliding-window 64 --draft-windows 0 \\
        --contexts 256 1024 4096 --iters 5 --device cpu --threads 1 --out /tmp/draft_context_cost.json

What a round's draft step costs (speculative/engine.py `_draft_step`: the drafter's context
K/V of the block verified last, then the proposal over its cache) when the sequence's block
starts at each context length, on the batch-1 engine exactly as `eval` builds it (CUDA graphs,
compiled layer functions and FlexAttention on a GPU). The slot is placed at that position
directly: what the step reads depends on the position and the cache's shape, not on the cached
values, so no prompt of 16K tokens has to be prefilled. A drafter whose every layer has a window
(its own, or `--draft-windows W`: decode full-attention layers with window W, a documented choice
that changes drafts, never outputs) keeps a ring of ~W + 2B positions and its cost stays flat; one
with a full-attention layer reads the whole context (speculative/static_drafter.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dflash_train.drafter.checkpoint import load_drafter
from dflash_train.drafter.config import drafter_config_from_target
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.generate.graphs import bucket_of
from dflash_train.speculative.engine import SpecEngine
from dflash_train.target.loading import load_target_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target", help="Hugging Face model directory or preset:NAME (random weights)")
    p.add_argument("--drafter", type=Path, help="exported drafter directory (default: a random one for the target)")
    p.add_argument("--block-size", type=int, default=16, help="block size of the random drafter")
    p.add_argument("--layers", type=int, default=5, help="layers of the random drafter")
    p.add_argument("--sliding-window", type=int, default=0, help="the random drafter's own window on every layer "
                   "(0: full attention, as drafter_config_from_target makes it)")
    p.add_argument("--draft-windows", type=int, nargs="+", default=[0, 2048],
                   help="engine draft_window values to compare (0: the drafter's own attention)")
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--iters", type=int, default=50, help="timed draft steps per point")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cuda or cpu")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def make_drafter(args, model, device: torch.device, dtype: torch.dtype) -> DFlashDrafter:
    if args.drafter is not None:
        return load_drafter(args.drafter, device=device, dtype=dtype).eval()
    rows = model.get_input_embeddings().weight.shape[0]
    cfg = drafter_config_from_target(model.config, mask_token_id=rows - 1, block_size=args.block_size,
                                     num_hidden_layers=args.layers, sliding_window=args.sliding_window or None)
    torch.manual_seed(0)
    return DFlashDrafter(cfg).to(device=device, dtype=dtype).eval()


def draft_ms(engine: SpecEngine, context: int, iters: int) -> float:
    """Median ms of the draft step with the slot's block at position `context` (CUDA: events
    around each replay; CPU: the wall clock)."""
    B = engine.block_size
    engine.positions.fill_(context)
    engine.block_start.fill_(context - B)  # last round verified the block before it
    kv = bucket_of(context + B, engine.buckets)
    cuda = engine.device.type == "cuda"
    for _ in range(3):  # capture and warm
        engine._draft(kv)
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            engine._draft(kv)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            engine._draft(kv)
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def measure(args, model, drafter, device) -> list[dict]:
    B = drafter.config.block_size
    max_len = max(args.contexts) + 2 * B
    rows = []
    for window in args.draft_windows:
        engine = SpecEngine(model, drafter, set(), slots=1, max_len=max_len, compile=not args.no_compile
                            and device.type == "cuda", draft_window=window or None)
        cache = engine.drafter.cache_len
        for context in args.contexts:
            ms = draft_ms(engine, context, args.iters)
            rows.append({"draft_window": window, "context": context, "draft_ms": round(ms, 4),
                         "drafter_cache_positions": cache, "ring": engine.drafter.ring_len is not None})
            print(f"  draft window {window or 'own':>5}  context {context:>6}  drafter cache {cache:>6}  "
                  f"{ms:8.3f} ms/round", flush=True)
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_target_model(args.target, dtype=dtype, device=device)
    drafter = make_drafter(args, model, device, dtype)
    cfg = drafter.config
    layer_windows = [cfg.window_of(i) for i in range(cfg.num_hidden_layers)]
    print(f"draft_context_cost: {args.target} + {args.drafter or 'random'} drafter ({cfg.num_hidden_layers} layers, "
          f"windows {layer_windows}, B = {cfg.block_size}), {device}", flush=True)
    rows = measure(args, model, drafter, device)
    by_mode = {str(w): {str(r["context"]): r["draft_ms"] for r in rows if r["draft_window"] == w}
               for w in args.draft_windows}
    results = {"config": {"target": args.target, "drafter": str(args.drafter or "random"), "layer_windows": layer_windows,
                          "block_size": cfg.block_size, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                          "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
                          "torch": torch.__version__, "iters": args.iters},
               "rows": rows, "draft_ms_per_round_by_context": by_mode}
    for w, points in by_mode.items():
        ms = list(points.values())
        print(f"draft window {w}: {' | '.join(f'{c}: {v:.3f}' for c, v in points.items())} ms; "
              f"largest / smallest context {ms[-1] / ms[0]:.2f}x")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
