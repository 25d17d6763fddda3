"""FlexAttention under different Triton kernel options (docs/performance.md, "The drafter step"):
the drafter's attention, or (`--shape gemma3-local`) a target's sliding-window layers.

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

`--shape gemma3-local`: the packed target's sliding-window layers at Gemma-3-27B's shape (one row
of 8192 tokens, 32 query heads, 16 KV heads, head dim 128, window 1024; the BlockMask of
utils/flex_masks.causal_document_block_mask), forward only as the frozen target runs it, beside
cuDNN's causal attention over the whole row (`sdpa-causal`, what the global layers run: 8x the
scores, a reference for the kernel's rate, not the same numbers):

    python bench/flex_kernel_options.py --shape gemma3-local --rows default fwd128x64w8 fwd64x64w4 fwd128x128w8 --autotune
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention, noop_mask

from dflash_train.drafter.anchors import select_anchors
from dflash_train.drafter.masks import flex_block_mask, make_mask_mod
from dflash_train.utils.flex_masks import causal_document_block_mask
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


def drafter_inputs(args, device, g) -> tuple[dict, tuple, dict]:
    """The drafter's attention: BlockMasks by row name, (q, k, v), the shape."""
    if args.tiny:
        S, N, B, heads, kv, hd, window = 512, 32, 8, 4, 2, 64, 128
    else:
        S, N, B, heads, kv, hd, window = 8192, 512, 16, 32, 8, 128, 2048
    doc = torch.zeros(1, S, dtype=torch.long, device=device)
    pos = torch.arange(S, device=device)[None]
    anchors, valid = select_anchors(torch.ones_like(doc, dtype=torch.bool), doc, N, B, generator=g, fixed_shape=True)
    masks = {}
    for tile in args.tiles:
        tiles = flex_block_mask(doc, pos, anchors, valid, B, sliding_window=window, tile=tile)  # range_mask_mod
        for m in args.mask_mods:
            masks[m + (f"@{tile}" if len(args.tiles) > 1 else "")] = with_mask_mod(
                tiles, m, doc, pos, anchors, valid, B, window)
    qkv = random_qkv(N * B, S + N * B, heads, kv, hd, device, g)
    return masks, qkv, dict(S=S, anchors=N, block=B, heads=heads, kv_heads=kv, head_dim=hd, window=window)


def target_window_inputs(args, device, g) -> tuple[dict, tuple, dict]:
    """A packed target's sliding-window layer (Gemma-3-27B): one document per row."""
    S, heads, kv, hd, window = (512, 4, 2, 64, 128) if args.tiny else (8192, 32, 16, 128, 1024)
    doc = torch.zeros(1, S, dtype=torch.long)
    masks = {f"window{window}@{tile}" if len(args.tiles) > 1 else "window":
             causal_document_block_mask(doc, tile=tile, window=window, device=device) for tile in args.tiles}
    return masks, random_qkv(S, S, heads, kv, hd, device, g), dict(S=S, heads=heads, kv_heads=kv, head_dim=hd,
                                                                   window=window)


def random_qkv(queries: int, keys: int, heads: int, kv: int, hd: int, device, g) -> tuple:
    shape = {"q": (1, heads, queries, hd), "k": (1, kv, keys, hd), "v": (1, kv, keys, hd)}
    return tuple(torch.randn(*shape[n], device=device, dtype=torch.bfloat16, generator=g) for n in "qkv")


def timed_ms(step, device, iters: int) -> float:
    """Mean milliseconds of `step()`: CUDA events on a GPU, the wall clock on a CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            step()
        return (time.perf_counter() - t0) * 1000 / iters
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        step()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / iters


def sdpa_causal_row(qkv: tuple, device, iters: int) -> dict:
    """cuDNN's (or the default backend's) causal attention over the whole row, forward only."""
    q, k, v = qkv

    def step():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    step()
    ms = timed_ms(step, device, iters)
    log(f"sdpa-causal: {ms:.3f} ms")
    return {"fwd_ms": ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", choices=["drafter", "gemma3-local"], default="drafter",
                    help="the drafter's attention (qwen3-8b preset), or a target's sliding-window layers")
    ap.add_argument("--tiny", action="store_true", help="small shapes for a CPU check (forward only)")
    ap.add_argument("--rows", nargs="*", default=list(OPTIONS), help=f"option sets, of {list(OPTIONS)}")
    ap.add_argument("--autotune", action="store_true", help="also a row compiled with mode=max-autotune-no-cudagraphs")
    ap.add_argument("--mask-mods", nargs="*", default=["ranges"], choices=["ranges", "rule", "noop"],
                    help="drafter shape: element-wise rules on the partial tiles (rows named MASK:OPTIONS "
                         "when more than one)")
    ap.add_argument("--tiles", nargs="*", type=int, default=[128],
                    help="BlockMask tile sizes (query and key; rows named MASK@TILE:OPTIONS when more than one). "
                         "At the qwen3-8b shape 128 computes 1.18x the visible scores, 64 1.08x")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="flex_kernel_options.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    inputs = drafter_inputs if args.shape == "drafter" else target_window_inputs
    masks, qkv, shape = inputs(args, device, g)
    # the frozen target runs forward only; FlexAttention has no backward on CPU
    backward = device.type == "cuda" and args.shape == "drafter"
    gout = torch.randn_like(qkv[0]) if backward else None
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
               "shape": {"name": args.shape, **shape}, "rows": {}}
    if args.shape != "drafter" and device.type == "cuda":
        results["rows"]["sdpa-causal"] = sdpa_causal_row(qkv, device, args.iters)
    rows = [(name, OPTIONS[name], "default") for name in args.rows]
    if args.autotune:
        rows.append(("max-autotune", {}, "max-autotune-no-cudagraphs"))
    rows = [(f"{m}:{name}" if len(masks) > 1 else name, options, mode, masks[m])
            for m in masks for name, options, mode in rows]
    reference = None
    for name, options, mode, mask in rows:
        torch._dynamo.reset()
        fn = torch.compile(flex_attention, mode=mode if mode != "default" else None)
        leaves = [t.detach().clone().requires_grad_(backward) for t in qkv]

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
            ms = timed_ms(step, device, args.iters)
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
