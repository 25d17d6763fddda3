"""Where a speculative round's time goes: kernels per step and their GPU time
(docs/eval.md, "Per-round cost on the GPU").

    python bench/profile_spec_round.py preset:smollm2-135m --attention dense flex --out runs/profile.json

For each attention kernel (generate/attention.py) the batch-1 engine's three steps (greedy:
T = 1 verify; verify: T = B; draft: drafter context + proposal) run eagerly under
torch.profiler (compiled layer functions, no CUDA graph, so every kernel is visible): kernel
count and summed kernel time per step, and the top kernels. Then each step replayed from its
CUDA graph, timed with CUDA events: what a round really costs. Weights are random (timing
depends on shapes only); all slots idle, so the steps commit nothing and can repeat.
`--position N` puts every slot at position N before each step (an idle slot's step sets it back
to 0; one fill kernel more a step), so attention reads N cached keys a slot, as mid-answer
(default 0), e.g. the batched case:

    python bench/profile_spec_round.py preset:smollm2-135m --slots 64 --position 384 --max-len 1024
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dflash_train.drafter.config import drafter_config_from_target
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.generate.graphs import bucket_of
from dflash_train.speculative.engine import SpecEngine
from dflash_train.target.loading import load_target_model


def kernels(fn, iters: int) -> dict:
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_name[e.name].append(e.device_time)
    count = sum(len(v) for v in per_name.values()) / iters
    total_us = sum(sum(v) for v in per_name.values()) / iters
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return {"kernels": round(count, 1), "kernel_us": round(total_us, 1),
            "top": [(name[:90], round(len(v) / iters, 1), round(sum(v) / iters, 1)) for name, v in top]}


def replay_ms(step, kv: int, reset, iters: int = 300) -> float:
    step(kv)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        reset()
        step(kv)
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / iters, 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("target")
    p.add_argument("--attention", nargs="+", default=["dense", "flex"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--slots", type=int, default=1, help="engine slots (1: the latency case)")
    p.add_argument("--position", type=int, default=0, help="every slot's position (the keys its attention reads)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if not 0 <= args.position <= args.max_len - 2 * args.block_size:
        p.error(f"--position must be in [0, --max-len - 2 x --block-size], got {args.position}")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    model = load_target_model(args.target, dtype=dtype, device=dev)
    rows = model.get_input_embeddings().weight.shape[0]
    cfg = drafter_config_from_target(model.config, mask_token_id=rows - 1, block_size=args.block_size)
    drafter = DFlashDrafter(cfg).to(device=dev, dtype=dtype).eval()
    results = {}
    for kind in args.attention:
        engine = SpecEngine(model, drafter, set(), slots=args.slots, max_len=args.max_len, compile=True,
                            attention=kind)
        reset = lambda positions=engine.positions: positions.fill_(args.position)  # noqa: E731
        kv = bucket_of(args.position + 2 * args.block_size, engine.buckets)
        steps = {"greedy": engine._verify[1], "verify": engine._verify[args.block_size], "draft": engine._draft}
        out = {}
        for name, step in steps.items():
            out[name] = kernels(lambda: (reset(), step.fn(kv)), 20)
            out[name]["graph_ms"] = replay_ms(step, kv, reset)
            print(f"{kind:5s} {name:6s}: {out[name]['kernels']:6.1f} kernels, {out[name]['kernel_us']:8.1f} us of "
                  f"kernels, {out[name]['graph_ms']:.4f} ms per graph replay", flush=True)
        g, v, d = (out[k]["graph_ms"] for k in ("greedy", "verify", "draft"))
        out["greedy_over_round"] = round(g / (v + d), 3)
        print(f"{kind}: greedy step / (verify + draft) = {out['greedy_over_round']} (the speedup/tau ceiling)")
        results[kind] = out
        del engine
        torch.cuda.empty_cache()
    for kind, out in results.items():
        for name in ("greedy", "verify", "draft"):
            print(f"--- {kind} {name} top kernels (calls/step, us/step)")
            for row in out[name]["top"]:
                print("   ", row)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
