"""The MoE layer's combine step alone (target/moe.py `weighted_sum_by_token` and the residual add
after it), compiled, against variants that move the same bytes, at Qwen3-30B-A3B's shapes (N 8,192
tokens, k 8, H 2,048, E 128; docs/performance.md, "Mixture-of-experts and Gemma 3 targets"). On
an H100 the current combine takes 173 us, the earlier sum over the gathered [N, k, H] 440 us.
    python bench/moe_combine_kernels.py                 # GPU: each variant's median us and GB/s
    python bench/moe_combine_kernels.py --tokens 256    # CPU: the variants agree (no timing)
Variants: `current` (target/moe.py: k row gathers x weights added up, + x), `sum_over_k` (the
earlier combine: y[inverse] viewed [N, k, H] x weights, summed over k, + x), `weights_first` (the weights
applied to the activation before `down`, so the combine is a gather and a sum), `contiguous`
(the same sum over rows already in token order: the floor a gather cannot beat), `gather_only`
(y[inverse] copied out: the gather's own rate), `no_index_asserts` (the current one compiled
without Inductor's device-side bounds check of each gathered index), `with_next_norm` (the
current one and the next layer's RMSNorm on its output, as the forward compiles them together).
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash_train.target.moe import grouped_offsets, weighted_sum_by_token
from drafter_flex_vs_dense import timed  # the benches' median of CUDA-event timings (bench/ is on sys.path)


def inputs(n: int, k: int, h: int, e: int, device: torch.device) -> dict:
    g = torch.Generator(device="cpu").manual_seed(0)
    experts = torch.rand(n, e, generator=g).topk(k, dim=-1)[1].to(device)
    weights = torch.rand(n, k, generator=g).softmax(-1).to(device, torch.bfloat16)
    grouping = grouped_offsets(experts, e)
    y = torch.randn(n * k, h, generator=g).to(device, torch.bfloat16)  # the down projection's rows, by expert
    x = torch.randn(n, h, generator=g).to(device, torch.bfloat16)  # the residual stream
    w_grouped = weights.reshape(-1)[grouping.order]  # each grouped row's routing weight
    return {"y": y, "x": x, "weights": weights, "inverse": grouping.inverse, "w_grouped": w_grouped}


def current(y, x, weights, inverse, w_grouped):
    return x + weighted_sum_by_token(y, inverse, weights)


def sum_over_k(y, x, weights, inverse, w_grouped):
    # the earlier combine: a reduction over the k axis of the gathered [N, k, H]
    n, k = weights.shape
    return x + (y[inverse].view(n, k, -1) * weights[..., None]).sum(dim=1)


def weights_first(y, x, weights, inverse, w_grouped):
    # in the real layer the weight scales silu(gate) * up before `down` (down is linear), fused
    # into that kernel; here the scaled rows stand in for its output
    n, k = weights.shape
    return x + y[inverse].view(n, k, -1).sum(dim=1)


def contiguous(y, x, weights, inverse, w_grouped):
    n, k = weights.shape
    return x + y.view(n, k, -1).sum(dim=1)


def gather_only(y, x, weights, inverse, w_grouped):
    return y[inverse]


def with_next_norm(y, x, weights, inverse, w_grouped):
    # as the packed forward compiles it: the next layer's RMSNorm reads the new residual stream,
    # and Inductor may fuse its reduction over H with the combine's over k
    r = x + weighted_sum_by_token(y, inverse, weights)
    return r, r * torch.rsqrt(r.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(r.dtype)


# name -> (function, Inductor settings it compiles under); `no_index_asserts`: the current combine
# without the device-side bounds check Inductor adds to each gathered index
VARIANTS = {"current": (current, {}), "sum_over_k": (sum_over_k, {}), "no_index_asserts": (current, {"assert_indirect_indexing": False}),
            "with_next_norm": (with_next_norm, {}), "weights_first": (weights_first, {}),
            "contiguous": (contiguous, {}), "gather_only": (gather_only, {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a = inputs(args.tokens, args.top_k, args.hidden, args.experts, device)
    ref = current(**a).float()
    scaled = dict(a, y=a["y"] * a["w_grouped"][:, None])  # weights_first's rows: scaled before the sum
    assert torch.allclose(weights_first(**scaled).float(), ref, atol=0.05, rtol=0.02), "weights_first differs"
    assert torch.allclose(sum_over_k(**a).float(), ref, atol=0.05, rtol=0.02), "sum_over_k differs"
    if device.type != "cuda":
        print("the variants agree (no timing without a GPU)")
        return
    n, k, h = args.tokens, args.top_k, args.hidden
    summed = (n * k * h + 2 * n * h) * 2  # bytes read + written: k rows and x in, one row out, a token
    results = {}
    for name, (fn, settings) in VARIANTS.items():
        moved = 2 * n * k * h * 2 if name == "gather_only" else summed
        torch._dynamo.reset()
        with torch._inductor.config.patch(settings):
            compiled = torch.compile(fn, dynamic=False)
            inputs_ = scaled if name == "weights_first" else a
            us = timed(lambda: compiled(**inputs_), device, repeat=args.iters, warmup=3) * 1000
        results[name] = {"us": round(us, 1), "GB_per_s": round(moved / us / 1e3, 1)}
        print(f"{name:16s} {us:8.1f} us  {moved / us / 1e3:7.1f} GB/s", flush=True)
    print(json.dumps({"tokens": n, "top_k": k, "hidden": h, "device": torch.cuda.get_device_name(), **results}))


if __name__ == "__main__":
    main()
