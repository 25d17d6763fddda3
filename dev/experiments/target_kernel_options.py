"""The packed target's kernels under candidate changes, one decoder layer at a time
(docs/performance.md, "The target forward").

At a preset's shapes (default qwen3-8b: one row of 8192 tokens) and with random bf16
weights, times with CUDA events (median of `--iters`, after warm-up):

* `gemm`:      each projection alone (cuBLAS through F.linear), and the concatenated q/k/v and
               gate/up projections, in TFLOP/s; the LM head plus argmax of the target labels
               at all 7,680 label rows and at the distinct ones of 512 random anchors
* `layer`:     pre_attention + attention + post_attention of target/packed.py, compiled as
               the packed forward compiles them, then with `mode=max-autotune-no-cudagraphs`,
               then with q/k/v and gate/up as one matmul each (`fused_pre_attention` /
               `fused_post_attention` here), each compared with the first by relative error
* `layout`:    each projection with its weight as stored ([N, K]) and transposed ([K, N])
* `attention`: causal attention over the row, k/v repeated (what the packed forward does)
               or grouped (`enable_gqa`), under each SDPA kernel, and FlexAttention

    python dev/experiments/target_kernel_options.py --out target_kernels.json            # GPU
    python dev/experiments/target_kernel_options.py --tiny --device cpu --sections gemm layer   # plumbing
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from dflash_train.drafter.anchors import select_anchors
from dflash_train.drafter.labels import predecessor_positions
from dflash_train.target.ops import apply_rope, rms_norm
from dflash_train.target.packed import post_attention, pre_attention
from dflash_train.target.presets import PRESETS
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # the bench scripts' helpers
from drafter_flex_vs_dense import log, rel_err, timed


def fused_pre_attention(x, cos, sin, ln1_w, qkv_w, qn_w, kn_w, *, eps, qk_eps, n_heads, n_kv, head_dim):
    """pre_attention with q, k and v as one matmul over the concatenated weight."""
    h = rms_norm(x, ln1_w, eps)
    R, S = h.shape[:2]
    q, k, v = F.linear(h, qkv_w).split([n_heads * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    q, k, v = q.view(R, S, n_heads, head_dim), k.view(R, S, n_kv, head_dim), v.view(R, S, n_kv, head_dim)
    q, k = rms_norm(q, qn_w, qk_eps), rms_norm(k, kn_w, qk_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    rep = n_heads // n_kv
    k = k[:, :, :, None].expand(R, S, n_kv, rep, head_dim).reshape(R, S, n_heads, head_dim)
    v = v[:, :, :, None].expand(R, S, n_kv, rep, head_dim).reshape(R, S, n_heads, head_dim)
    return q, k, v


def fused_post_attention(x, attn_out, o_w, ln2_w, gate_up_w, down_w, *, eps):
    """post_attention with gate and up as one matmul over the concatenated weight."""
    x = x + F.linear(attn_out, o_w)
    h = rms_norm(x, ln2_w, eps)
    gate, up = F.linear(h, gate_up_w).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, down_w)


def dims(preset: str, tiny: bool) -> dict:
    if tiny:
        return dict(H=64, heads=4, kv=2, hd=16, I=128, V=512, S=256, N=8, B=4)
    p = PRESETS[preset]
    return dict(H=p["hidden_size"], heads=p["num_attention_heads"], kv=p["num_key_value_heads"], hd=p["head_dim"],
                I=p["intermediate_size"], V=p["vocab_size"], S=8192, N=512, B=16)


def section_gemm(d, device, iters, rows):
    H, I, V, S = d["H"], d["I"], d["V"], d["S"]
    q, kv = d["heads"] * d["hd"], d["kv"] * d["hd"]
    shapes = {"q": (S, H, q), "k": (S, H, kv), "qkv": (S, H, q + 2 * kv), "o": (S, q, H),
              "gate": (S, H, I), "gate_up": (S, H, 2 * I), "down": (S, I, H)}
    for name, (M, K, N) in shapes.items():
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
        ms = timed(lambda: F.linear(x, w), device, repeat=iters, warmup=3)
        rows.append(dict(section="gemm", row=name, M=M, K=K, N=N, ms=ms, tflops=2 * M * K * N / ms / 1e9))
        log(f"gemm {name:8s} [{M}x{K}] x [{K}x{N}]: {ms:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s")
    # the target labels: LM head + argmax at every label row, and at the distinct positions
    mask = torch.ones(1, S, dtype=torch.bool, device=device)
    anchors, valid = select_anchors(mask, torch.zeros(1, S, dtype=torch.long, device=device), d["N"], d["B"],
                                    generator=torch.Generator(device=device).manual_seed(0), fixed_shape=True)
    pos = predecessor_positions(anchors, d["B"], S)[valid]
    distinct = int(torch.unique(pos).numel())
    w = torch.randn(V, H, device=device, dtype=torch.bfloat16) * 0.02
    for name, M in (("labels_all", pos.numel()), ("labels_distinct", distinct)):
        x = torch.randn(M, H, device=device, dtype=torch.bfloat16)
        ms = timed(lambda: (x @ w.T).argmax(-1), device, repeat=iters, warmup=3)
        rows.append(dict(section="gemm", row=name, M=M, K=H, N=V, ms=ms, tflops=2 * M * H * V / ms / 1e9))
        log(f"gemm {name}: {M} rows, {ms:.3f} ms ({rows[-1]['tflops']:.0f} TFLOP/s incl. argmax)")


def section_layout(d, device, iters, rows):
    """Each projection with its weight stored as Hugging Face stores it ([N, K], F.linear) and
    transposed once ([K, N] contiguous, x @ w_t): cuBLAS picks a different kernel for each."""
    H, I, S = d["H"], d["I"], d["S"]
    q, kv = d["heads"] * d["hd"], d["kv"] * d["hd"]
    shapes = {"q": (S, H, q), "k": (S, H, kv), "o": (S, q, H), "gate": (S, H, I), "down": (S, I, H)}
    for name, (M, K, N) in shapes.items():
        x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
        w = torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
        w_t = w.t().contiguous()
        ref = F.linear(x, w)
        for layout, fn in (("nk", lambda: F.linear(x, w)), ("kn", lambda: x @ w_t)):
            ms = timed(fn, device, repeat=iters, warmup=3)
            rows.append(dict(section="layout", row=f"{name}/{layout}", M=M, K=K, N=N, ms=ms,
                             tflops=2 * M * K * N / ms / 1e9, rel_err=rel_err(fn(), ref)))
            log(f"layout {name:5s} weight [{layout}]: {ms:.3f} ms, {rows[-1]['tflops']:.0f} TFLOP/s")


def section_layer(d, device, iters, rows):
    H, heads, kv, hd, I, S = d["H"], d["heads"], d["kv"], d["hd"], d["I"], d["S"]
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape, scale=0.02):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=g) * scale

    x = rnd(1, S, H, scale=1.0)
    wq, wk, wv, wo = rnd(heads * hd, H), rnd(kv * hd, H), rnd(kv * hd, H), rnd(H, heads * hd)
    wg, wu, wd = rnd(I, H), rnd(I, H), rnd(H, I)
    ln1, ln2, qn, kn = (torch.ones(n, device=device, dtype=torch.bfloat16) for n in (H, H, hd, hd))
    pos = torch.arange(S, device=device, dtype=torch.float32)
    freqs = pos[:, None] / (1e6 ** (torch.arange(0, hd, 2, device=device) / hd))[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = (t.to(torch.bfloat16)[None, :, None, :] for t in (emb.cos(), emb.sin()))
    kw = dict(eps=1e-6, qk_eps=1e-6, n_heads=heads, n_kv=kv, head_dim=hd)

    def attention(q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return o.transpose(1, 2).reshape(1, S, heads * hd)

    wqkv, wgu = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
    variants = {
        "packed": (pre_attention, post_attention,
                   lambda pre: pre(x, cos, sin, ln1, (wq, None), (wk, None), (wv, None), qn, kn, **kw),
                   lambda post, a: post(x, a, (wo, None), ln2, (wg, None), (wu, None), (wd, None), eps=1e-6)),
        "fused": (fused_pre_attention, fused_post_attention,
                  lambda pre: pre(x, cos, sin, ln1, wqkv, qn, kn, **kw),
                  lambda post, a: post(x, a, wo, ln2, wgu, wd, eps=1e-6)),
    }
    ref = None
    for name, (pre_fn, post_fn, call_pre, call_post) in variants.items():
        for mode in ("default", "max-autotune-no-cudagraphs"):
            if device.type != "cuda" and mode != "default":
                continue
            torch._dynamo.reset()
            opts = dict(dynamic=False, fullgraph=True) | ({} if mode == "default" else {"mode": mode})
            pre, post = torch.compile(pre_fn, **opts), torch.compile(post_fn, **opts)
            log(f"layer {name}/{mode}: compiling")
            with torch.no_grad():
                q, k, v = call_pre(pre)
                a = attention(q, k, v)
                out = call_post(post, a)
                t_pre = timed(lambda: call_pre(pre), device, repeat=iters, warmup=3)
                t_attn = timed(lambda: attention(q, k, v), device, repeat=iters, warmup=3)
                t_post = timed(lambda: call_post(post, a), device, repeat=iters, warmup=3)
            ref = out if ref is None else ref
            row = dict(section="layer", row=f"{name}/{mode}", pre_ms=t_pre, attention_ms=t_attn, post_ms=t_post,
                       layer_ms=t_pre + t_attn + t_post, rel_err=rel_err(out, ref))
            rows.append(row)
            log(f"layer {name}/{mode}: pre {t_pre:.3f} + attention {t_attn:.3f} + post {t_post:.3f} = "
                f"{row['layer_ms']:.3f} ms/layer; rel err {row['rel_err']:.2e}")


def section_attention(d, device, iters, rows):
    heads, kv, hd, S = d["heads"], d["kv"], d["hd"], d["S"]
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(1, heads, S, hd, device=device, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(1, kv, S, hd, device=device, dtype=torch.bfloat16, generator=g) for _ in range(2))
    rep = heads // kv
    k_rep, v_rep = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    flops = 4 * S * S * hd * heads / 2
    ref = F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)
    backends = {"auto": None, "cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    cases = []
    for name, backend in backends.items():
        cases.append((f"{name}/repeat", backend,
                      lambda: F.scaled_dot_product_attention(q, k_rep, v_rep, is_causal=True)))
        cases.append((f"{name}/gqa", backend,
                      lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))
    if device.type == "cuda":
        block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=device)
        flex = torch.compile(flex_attention, dynamic=False, fullgraph=True)
        cases.append(("flex/gqa", None, lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=True)))
    for name, backend, fn in cases:
        ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
        try:
            with ctx, torch.no_grad():
                out = fn()
                ms = timed(fn, device, repeat=iters, warmup=3)
        except Exception as e:  # a kernel that cannot take the call: say so, go on
            rows.append(dict(section="attention", row=name, error=f"{type(e).__name__}: {str(e)[:200]}"))
            log(f"attention {name}: not available ({type(e).__name__})")
            continue
        rows.append(dict(section="attention", row=name, ms=ms, tflops=flops / ms / 1e9, rel_err=rel_err(out, ref)))
        log(f"attention {name}: {ms:.3f} ms ({rows[-1]['tflops']:.0f} TFLOP/s causal), "
            f"rel err {rows[-1]['rel_err']:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="qwen3-8b", choices=[p for p in PRESETS if p != "tiny"])
    ap.add_argument("--tiny", action="store_true", help="small shapes for a CPU check")
    ap.add_argument("--sections", nargs="*", default=["gemm", "attention", "layer"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="target_kernel_options.json")
    args = ap.parse_args()
    device = torch.device(args.device)
    d = dims(args.preset, args.tiny)
    log(f"{args.preset if not args.tiny else 'tiny'} on {device}: {d}")
    rows: list[dict] = []
    sections = {"gemm": section_gemm, "layout": section_layout, "layer": section_layer, "attention": section_attention}
    for name in args.sections:
        sections[name](d, device, args.iters, rows)
        with open(args.out, "w") as f:  # after each section, so a later failure keeps the earlier rows
            json.dump(dict(preset=args.preset, dims=d, device=str(device), rows=rows), f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
