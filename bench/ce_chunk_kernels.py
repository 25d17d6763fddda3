"""The LM head's per-chunk cross-entropy math alone (docs/performance.md, "The drafter step").

`drafter/head_kernel.py` runs, between the head's two matmuls, one function per [chunk_rows, vocab]
chunk of logits: the statistics (log-sum-exp, the label's logit, the argmax) and the gradient
softmax - onehot written in the head's dtype. It must read the chunk twice and write the
gradient once. This times (CUDA events, median of `--iters`) and checks against the eager
definitions, at the qwen3-8b shape (4096 x 151,936 bf16):

  inductor[:OPTS]  the whole chunk function as Inductor compiles it (the code before
                   drafter/row_stats.py), under Inductor options: `cdt` coordinate-descent
                   tuning, `autotune` + pointwise autotuning, `two-pass` online softmax off;
  current          what the loss runs in compiled mode: row_stats (Triton on a GPU) + the
                   compiled gradient;
  eager            what it runs in eager mode: row_stats + the three-pass gradient
                   (`_softmax_minus_onehot_eager`); `eager-onehot` the uncompiled one-hot
                   form it replaced (seven passes);
  triton:BxW       row_stats' kernel alone with B columns a step and W warps;
  lanes:BxW        a candidate kernel that keeps a max, a sum and an argmax per lane of the
                   block (2 exponentials an element, no reduction across warps until the end)
                   instead of row_stats' per-block reductions;
  argmax           torch's argmax of the chunk (what the target-label head does per chunk).

Each row has a `/stats` twin without the gradient (what the statistics alone cost).

    python bench/ce_chunk_kernels.py --out ce_chunk_kernels.json          # GPU
    python bench/ce_chunk_kernels.py --tiny --device cpu                  # plumbing
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_train.drafter import row_stats as row_stats_module
from dflash_train.drafter.head_kernel import _hard_label_chunk, _softmax_minus_onehot, _softmax_minus_onehot_eager
from drafter_flex_vs_dense import log, rel_err, timed  # the sibling bench's helpers (bench/ is on sys.path)

INDUCTOR_OPTIONS: dict[str, dict] = {
    "": {},
    "cdt": {"coordinate_descent_tuning": True},
    "autotune": {"max_autotune_pointwise": True, "coordinate_descent_tuning": True},
    "two-pass": {"online_softmax": False},
}
KERNEL_CONFIGS = ["2048x4", "4096x8", "8192x8", "8192x16", "16384x16"]
LANES_CONFIGS = ["1024x4", "2048x4", "2048x8", "4096x8", "4096x16"]


def inductor_chunk(logits: torch.Tensor, labels: torch.Tensor, need_grad: bool):
    """The chunk function before drafter/row_stats.py: every statistic as a torch op, for
    Inductor to fuse into one reduction (an online softmax with an argmax)."""
    lf = logits.float()
    m = lf.amax(dim=-1, keepdim=True)
    lse = (m + (lf - m).exp().sum(dim=-1, keepdim=True).log()).squeeze(1)
    ce = lse - lf.gather(1, labels[:, None]).squeeze(1)
    pred = lf.argmax(dim=-1)
    if not need_grad:
        return ce, pred, None
    is_label = torch.arange(lf.shape[1], device=lf.device) == labels[:, None]
    return ce, pred, torch.exp(lf - lse[:, None]).sub_(is_label.to(torch.uint8)).to(logits.dtype)


if row_stats_module.triton is not None:
    tl = row_stats_module.tl

    @row_stats_module.triton.jit
    def _lanes_kernel(x_ptr, labels_ptr, lse_ptr, label_logit_ptr, arg_ptr, V, stride_row, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride_row
        cols = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK,), tl.float32)
        arg = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, V, BLOCK):
            idx = start + cols
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            new_m = tl.maximum(m, x)
            # lanes that have seen only padding keep s = 0 (exp(-inf - -inf) would be NaN)
            seen = new_m > float("-inf")
            s = tl.where(seen, s * tl.exp(m - new_m) + tl.exp(x - new_m), 0.0)
            arg = tl.where(x > m, idx, arg)  # strictly larger: each lane keeps its first index
            m = new_m
        row_max = tl.max(m, 0)
        total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - row_max), 0.0), 0)
        first = tl.min(tl.where(m == row_max, arg, V), 0)  # the first index of the max over lanes
        tl.store(lse_ptr + row, row_max + tl.log(total))
        label = tl.load(labels_ptr + row)
        tl.store(label_logit_ptr + row, tl.load(base + label).to(tl.float32))
        tl.store(arg_ptr + row, first.to(tl.int64))


def lanes_stats(logits: torch.Tensor, labels: torch.Tensor, block: int, warps: int):
    rows, V = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    label_logit, arg = torch.empty_like(lse), torch.empty(rows, dtype=torch.int64, device=logits.device)
    _lanes_kernel[(rows,)](logits, labels, lse, label_logit, arg, V, logits.stride(0), BLOCK=block, num_warps=warps)
    return lse - label_logit, arg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--tiny", action="store_true", help="64 x 1000, for a CPU check")
    ap.add_argument("--inductor", nargs="*", default=["", "cdt", "two-pass"], help=f"of {list(INDUCTOR_OPTIONS)}")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="ce_chunk_kernels.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows, vocab = (64, 1000) if args.tiny else (args.rows, args.vocab)
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, vocab, device=device, generator=g) * 4).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device=device, generator=g)
    passes = 3 * rows * vocab * logits.element_size()  # read twice, write the gradient once
    log(f"chunk [{rows}, {vocab}] bf16: {passes / 1e9:.2f} GB in the 3 passes")
    reference = inductor_chunk(logits, labels, True)  # eager: the definitions
    results = {"rows": rows, "vocab": vocab, "bytes_3_passes": passes, "variants": {}}

    def row(name: str, run, full: bool) -> None:
        out = run()
        errs = {"ce": rel_err(out[0], reference[0]), "pred_mismatches": int((out[1] != reference[1]).sum())}
        if full:
            errs["grad"] = rel_err(out[2], reference[2])
        ms = timed(run, device, repeat=args.iters, warmup=2)
        results["variants"][name] = {"ms": ms, **errs, **({"GB/s_3_passes": passes / ms / 1e6} if full else {})}
        log(f"{name:<24} {ms:7.3f} ms  {errs}" + (f"  {passes / ms / 1e6:.0f} GB/s (3 passes)" if full else ""))

    for opts in args.inductor:
        for full in (True, False):
            torch._dynamo.reset()
            fn = torch.compile(inductor_chunk, dynamic=False, fullgraph=True, options=INDUCTOR_OPTIONS[opts])
            row(f"inductor{':' + opts if opts else ''}{'' if full else '/stats'}",
                lambda fn=fn, full=full: fn(logits, labels, full), full)
    torch._dynamo.reset()
    grad = torch.compile(_softmax_minus_onehot, dynamic=False, fullgraph=True)
    for full in (True, False):
        row("current" + ("" if full else "/stats"), lambda full=full: _hard_label_chunk(logits, labels, full, grad), full)
    for name, fn in (("eager", _softmax_minus_onehot_eager), ("eager-onehot", _softmax_minus_onehot)):
        row(name, lambda fn=fn: _hard_label_chunk(logits, labels, True, fn), True)
    if device.type == "cuda" and row_stats_module.triton is not None:
        for config in KERNEL_CONFIGS:
            block, warps = (int(x) for x in config.split("x"))

            def stats(block=block, warps=warps):
                lse, label_logit, arg = row_stats_module._row_stats_triton(logits, labels, block, warps)
                return lse - label_logit, arg

            row(f"triton:{config}/stats", stats, False)
        for config in LANES_CONFIGS:
            block, warps = (int(x) for x in config.split("x"))
            row(f"lanes:{config}/stats", lambda block=block, warps=warps: lanes_stats(logits, labels, block, warps), False)
    argmax_ms = timed(lambda: logits.argmax(-1), device, repeat=args.iters, warmup=2)
    results["variants"]["argmax"] = {"ms": argmax_ms}
    log(f"{'argmax':<24} {argmax_ms:7.3f} ms")
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
