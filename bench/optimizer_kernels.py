"""The drafter's optimizer step alone, under candidate implementations (docs/performance.md, "The drafter step").

The fused AdamW of train/optimizer.py reads and writes ~14 bytes per bf16 parameter (param,
grad, two moments); at the qwen3-8b preset's ~1.05B drafter parameters that is ~14.7 GB, a
memory-bound pass. This times it (CUDA events, median of `--iters`) against torch's foreach
AdamW compiled by Inductor (the library's other fast path; it cannot take the step's grad
scale and skip flag, so it is a bound, not a candidate) and reports the achieved bandwidth.
It also times the step's other pass, the gradients' global norm: torch's `get_total_norm`
against an Inductor-compiled sum of squares (on an H200: 1.12 against 1.50 ms, torch's kept).

    python bench/optimizer_kernels.py --out optimizer_kernels.json     # GPU
    python bench/optimizer_kernels.py --tiny --device cpu              # plumbing
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_train.drafter.config import DrafterSpec, build_drafter_config
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.target.presets import preset_config
from drafter_flex_vs_dense import log, timed  # the sibling bench's helpers (bench/ is on sys.path)


def bytes_per_step(params: list[torch.Tensor]) -> int:
    """param read + write, grad read, exp_avg and exp_avg_sq read + write, all in the params' dtype."""
    return sum(p.numel() * p.element_size() * 7 for p in params)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--tiny", action="store_true", help="the tiny preset, for a CPU check")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="optimizer_kernels.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    preset = "tiny" if args.tiny else args.preset
    cfg = build_drafter_config(DrafterSpec(num_layers=args.layers), preset_config(f"preset:{preset}"), mask_token_id=0)
    model = DFlashDrafter(cfg).to(device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    n = sum(p.numel() for p in params)
    log(f"{preset}: {len(params)} tensors, {n / 1e9:.3f}B parameters, {bytes_per_step(params) / 1e9:.2f} GB per step")
    g = torch.Generator(device=device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=device, dtype=dtype) * 1e-3
    results = {"preset": preset, "params": n, "tensors": len(params), "bytes": bytes_per_step(params), "rows": {}}

    def row(name: str, fn, nbytes: int | None = None) -> None:
        """`nbytes`: the traffic the GB/s column counts (default: the optimizer step's)."""
        ms = timed(fn, device, repeat=args.iters, warmup=3)
        gbs = (nbytes or bytes_per_step(params)) / ms / 1e6
        results["rows"][name] = {"ms": ms, "GB/s": gbs}
        log(f"{name:<28} {ms:8.3f} ms  {gbs:8.0f} GB/s")

    fused = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    scale, found_inf = torch.tensor(1.5, device=device), torch.zeros((), device=device)

    def fused_step():
        fused.grad_scale, fused.found_inf = scale, found_inf  # what train/step.apply_gradients sets
        fused.step()
        del fused.grad_scale, fused.found_inf

    row("fused (grad_scale, found_inf)", fused_step)
    row("fused (plain)", fused.step)
    norm = lambda: torch.nn.utils.get_total_norm([p.grad for p in params])  # noqa: E731 the step's other pass
    grads = [p.grad for p in params]
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)  # the norm reads each gradient once
    row("grad norm", norm, grad_bytes)
    sq_sum = torch.compile(lambda gs: torch.stack([g.float().pow(2).sum() for g in gs]).sum().sqrt(),
                           dynamic=False, fullgraph=True)  # a candidate: Inductor's reductions, one per tensor
    log("compiling the grad norm")
    log(f"grad norm (compiled) rel err {float((sq_sum(grads) - norm()).abs() / norm()):.1e}")
    row("grad norm (compiled)", lambda: sq_sum(grads), grad_bytes)
    fused = None  # its state freed before the next optimizer (a del would hide it from fused_step)
    cuda = device.type == "cuda"  # a tensor lr (no recompile per lr) needs capturable, which needs a GPU
    foreach = torch.optim.AdamW(params, lr=torch.tensor(1e-4, device=device) if cuda else 1e-4, weight_decay=0.01,
                                foreach=True, capturable=cuda)
    row("foreach (eager)", foreach.step)
    compiled = torch.compile(foreach.step)
    log("compiling the foreach step")
    row("foreach (compiled)", compiled)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
