"""The drafter's FlexAttention under different Triton kernel options (docs/performance.md, "The drafter step").

The bench's drafter attention shape (qwen3-8b preset: one row of S = 8192 tokens, 512
sorted anchors, B = 16, window 2048, 32 query heads, 8 KV heads, head dim 128; the mask of
drafter/masks.py) timed as one compiled flex_attention forward + backward per option set,
with CUDA events. Each option set's output and gradients are compared with the default
kernel's by relative error, so an option that changes the numbers shows.

    python bench/flex_kernel_options.py --out flex_options.json              # GPU
    python bench/flex_kernel_options.py --tiny --device cpu --rows default   # a quick check
    python bench/flex_kernel_options.py --rows default --mask-mods ranges rule noop   # the partial tiles' rule

`--mask-mods` keeps the tiles and swaps the element-wise rule of the partial ones: `ranges`
(what the drafter uses), `rule` (the spec's `make_mask_mod`, used before),
`noop` (no masking inside the tiles: wrong numbers, the bound on what cheaper masking can save).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention, noop_mask

from dflash_train.drafter.anchors import select_anchors
from dflash_train.drafter.masks import flex_block_mask, make_mask_mod
from drafter_flex_vs_dense import log, rel_err  # the sibling bench's helpers (bench/ is on sys.path)

# Named option sets. `rows-safe` (ROWS_GUARANTEED_SAFE) gave NaN against the default on an
# H200 (2026-12-01): every DFlash query sees a key somewhere (its own block), but a sliding-window
# row's first visited tile is often a partial one it sees nothing of, and the flag drops the
# guard for a row whose running max is still -inf. It stays as a row to show that; the tile
# rows leave it out.
OPTIONS: dict[str, dict] = {
    "default": {},
    "rows-safe": {"ROWS_GUARANTEED_SAFE": True},
    "prescale": {"PRESCALE_QK": True},
    "no-write-dq": {"WRITE_DQ": False},
    "tma": {"USE_TMA": True},
    "fwd128x64w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8, "fwd_num_stages": 3},
    "fwd64x64w4": {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "fwd128x128w8": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "bwd64x128w8": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 64,
                    "bwd_num_warps": 8, "bwd_num_stages": 3},
    "bwd32x128w4": {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                    "bwd_num_warps": 4, "bwd_num_stages": 3},
    "bwd64x64w4": {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                   "bwd_num_warps": 4, "bwd_num_stages": 3},
}


def with_mask_mod(tiles: BlockMask, name: str, doc, pos, anchors, valid, B: int, window: int) -> BlockMask:
    """The same tiles with another element-wise rule on the partial ones: `ranges` (what
    drafter/masks.py hands FlexAttention, `range_mask_mod`), `rule` (`make_mask_mod`, the
    spec's rule with per-key document and position lookups; the drafter's rule before `ranges`),
    `noop` (everything visible inside the listed tiles: wrong numbers, the cost of no masking)."""
    if name == "ranges":
        return tiles
    if name == "rule":
        mask_mod = make_mask_mod(doc, pos, anchors, valid, B, sliding_window=window)
    elif name == "noop":
        mask_mod = noop_mask
    else:
        raise ValueError(f"unknown mask mod {name!r}")
    return BlockMask.from_kv_blocks(tiles.kv_num_blocks, tiles.kv_indices, tiles.full_kv_num_blocks,
                                    tiles.full_kv_indices, BLOCK_SIZE=tiles.BLOCK_SIZE, mask_mod=mask_mod,
                                    seq_lengths=tiles.seq_lengths)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="small shapes for a CPU check (forward only)")
    ap.add_argument("--rows", nargs="*", default=list(OPTIONS), help=f"option sets, of {list(OPTIONS)}")
    ap.add_argument("--autotune", action="store_true", help="also a row compiled with mode=max-autotune-no-cudagraphs")
    ap.add_argument("--mask-mods", nargs="*", default=["ranges"], choices=["ranges", "rule", "noop"],
                    help="element-wise rules on the partial tiles (rows named MASK:OPTIONS when more than one)")
    ap.add_argument("--tiles", nargs="*", type=int, default=[128],
                    help="BlockMask tile sizes (query and key; rows named MASK@TILE:OPTIONS when more than one). "
                         "At the qwen3-8b shape 128 computes 1.18x the visible scores, 64 1.08x")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="flex_kernel_options.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        S, N, B, heads, kv, hd, window = 512, 32, 8, 4, 2, 64, 128
    else:
        S, N, B, heads, kv, hd, window = 8192, 512, 16, 32, 8, 128, 2048
    g = torch.Generator(device=device).manual_seed(0)
    doc = torch.zeros(1, S, dtype=torch.long, device=device)
    pos = torch.arange(S, device=device)[None]
    anchors, valid = select_anchors(torch.ones_like(doc, dtype=torch.bool), doc, N, B, generator=g, fixed_shape=True)
    masks = {}
    for tile in args.tiles:
        tiles = flex_block_mask(doc, pos, anchors, valid, B, sliding_window=window, tile=tile)  # range_mask_mod
        for m in args.mask_mods:
            masks[m + (f"@{tile}" if len(args.tiles) > 1 else "")] = with_mask_mod(
                tiles, m, doc, pos, anchors, valid, B, window)
    Q = N * B
    dtype = torch.bfloat16
    q = torch.randn(1, heads, Q, hd, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, kv, S + Q, hd, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, kv, S + Q, hd, device=device, dtype=dtype, generator=g)
    gout = torch.randn(1, heads, Q, hd, device=device, dtype=dtype, generator=g)
    backward = device.type == "cuda"  # FlexAttention has no backward on CPU
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
               "shape": dict(S=S, anchors=N, block=B, heads=heads, kv_heads=kv, head_dim=hd, window=window),
               "rows": {}}
    rows = [(name, OPTIONS[name], "default") for name in args.rows]
    if args.autotune:
        rows.append(("max-autotune", {}, "max-autotune-no-cudagraphs"))
    rows = [(f"{m}:{name}" if len(masks) > 1 else name, options, mode, masks[m])
            for m in masks for name, options, mode in rows]
    reference = None
    for name, options, mode, mask in rows:
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, mode=mode if mode != "default" else None)
        leaves = [t.detach().clone().requires_grad_(backward) for t in (q, k, v)]

        def step():
            out = fn(*leaves, block_mask=mask, enable_gqa=True, kernel_options=options or None)
            if backward:
                out.backward(gout)
            return out

        try:
            log(f"{name}: compiling")
            out = step()
            got = [out.detach()] + ([t.grad.detach().clone() for t in leaves] if backward else [])
            if reference is None:
                reference = got
            errs = [rel_err(a, b) for a, b in zip(got, reference)]
            for t in leaves:
                t.grad = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for _ in range(args.iters):
                    step()
                end.record()
                end.synchronize()
                ms = begin.elapsed_time(end) / args.iters
            else:
                t0 = time.perf_counter()
                for _ in range(args.iters):
                    step()
                ms = (time.perf_counter() - t0) * 1000 / args.iters
            results["rows"][name] = {"options": options, "mode": mode, "fwd_bwd_ms" if backward else "fwd_ms": ms,
                                     "rel_err_vs_first": errs}
            log(f"{name}: {ms:.3f} ms, rel err vs first row {['%.1e' % e for e in errs]}")
        except Exception as exc:  # an option set the kernel rejects: report it, go on
            results["rows"][name] = {"options": options, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            log(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=2)
    print(f"\n{'options':<24}{'ms':>10}{'max rel err':>13}")
    for name, r in results["rows"].items():
        ms = r.get("fwd_bwd_ms", r.get("fwd_ms"))
        print(f"{name:<24}{ms if ms is not None else float('nan'):>10.3f}"
              f"{max(r['rel_err_vs_first']) if 'rel_err_vs_first' in r else float('nan'):>13.1e}")


if __name__ == "__main__":
    main()
