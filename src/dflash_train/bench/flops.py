"""Analytic model FLOPs of one training step (the numerator of MFU), the measured matmul peaks
of the device (its denominator), and MFU.

Counted: every matmul of the target forward (up to the last tapped layer with `data`
labels, the whole stack with `target` labels, plus the LM head at the distinct label
positions only: `expected_label_rows`), and of the drafter forward (context projection,
context K/V, block-token layers with the first one's q/k/v at the anchors and one mask row,
attention over the keys each query may see, LM head + cross-entropy gradient) and its
backward (2x the trainable forward). Attention counts 4*h*hd FLOPs per (query, key) pair
in the forward pass. Elementwise work (norms, RoPE, softmax) is not counted.
"""

from __future__ import annotations

import numpy as np
import torch

from dflash_train.drafter.config import default_target_layer_ids
from dflash_train.target.fp8 import fp8_matmul, quantize_rows
from dflash_train.target.presets import preset_config


def _doc_length(spec: str) -> float:
    lo, _, hi = spec.split(":")[2].partition("-")
    return (int(lo) + int(hi or lo)) / 2


def expected_label_rows(candidates: int, anchors: int, block: int) -> float:
    """Expected count of distinct positions a + k - 1 (k = 1..B-1, kept inside the candidate
    range as valid labels are) when `anchors` anchors are drawn without replacement from
    `candidates` consecutive candidate positions: the rows at which `target` labels run the
    LM head (drafter/labels.needed_label_rows). Position p (an offset into the range) is
    needed unless none of the min(p + 1, B - 1) anchors whose block holds it was drawn."""
    C, w = int(candidates), block - 1
    n = min(int(anchors), C)
    if C <= 0 or n <= 0 or w <= 0:
        return 0.0
    i = np.arange(min(w, C), dtype=np.float64)  # a position is covered by at most min(w, C) candidates
    # none_drawn[m - 1] = P(none of m given candidates drawn) = prod_{i<m} (C - n - i) / (C - i)
    none_drawn = np.cumprod(np.clip((C - n - i) / (C - i), 0.0, None))
    covering = np.minimum(np.arange(C) + 1, w)
    return float((1.0 - none_drawn[covering - 1]).sum())


def routed_experts(t) -> int:
    """How many routed experts the config's mixtures have (0: a dense model)."""
    return int(getattr(t, "num_experts", None) or getattr(t, "num_local_experts", None)
               or getattr(t, "n_routed_experts", None) or 0)


def has_experts(t, layer: int) -> bool:
    """Whether decoder layer `layer` runs a mixture of experts: GLM-4.7-Flash lists each layer's
    MLP, GLM-4.5 and DeepSeek-V3 keep their first layers dense, Qwen3-MoE names its dense ones."""
    if not routed_experts(t):
        return False
    kinds = getattr(t, "mlp_layer_types", None)
    if kinds:
        return kinds[layer] == "sparse"
    if layer < (getattr(t, "first_k_dense_replace", None) or 0) or layer in (getattr(t, "mlp_only_layers", None) or ()):
        return False
    return (layer + 1) % (getattr(t, "decoder_sparse_step", None) or 1) == 0


def mlp_flops_per_token(t, layer: int = 0) -> float:
    """Matmul FLOPs of decoder layer `layer`'s MLP for one token: the dense gated MLP, or for a
    mixture of experts the router plus the experts each token is routed to and the shared experts
    (Qwen's one with its 1-wide gate; GLM's and DeepSeek's n_shared_experts)."""
    H = t.hidden_size
    if not has_experts(t, layer):
        return 2 * 3 * H * t.intermediate_size
    inter = getattr(t, "moe_intermediate_size", None) or t.intermediate_size
    qwen_shared = getattr(t, "shared_expert_intermediate_size", None) or 0
    shared = qwen_shared or (getattr(t, "n_shared_experts", None) or 0) * inter
    return 2 * (H * routed_experts(t) + 3 * H * inter * t.num_experts_per_tok + 3 * H * shared
                + (H if qwen_shared else 0))


GATED_ATTENTION_MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")  # q_proj also writes a gate for the output


def attention_flops_per_token(t, kind: str) -> float:
    """Matmul FLOPs of one layer's attention projections for one token: q, k, v, o; latent
    attention's (q_a and q_b or q_proj, kv_a, kv_b, o); or a linear-attention layer's (Qwen3.5 /
    Qwen3-Next gated delta net: qkv, z, a, b in; out)."""
    H = t.hidden_size
    if getattr(t, "kv_lora_rank", None):  # DeepSeek-V3, GLM-4.7-Flash
        h, nope, rope, v = t.num_attention_heads, t.qk_nope_head_dim, t.qk_rope_head_dim, t.v_head_dim
        q_rank = getattr(t, "q_lora_rank", None)
        q = H * q_rank + q_rank * h * (nope + rope) if q_rank else H * h * (nope + rope)
        return 2 * (q + H * (t.kv_lora_rank + rope) + t.kv_lora_rank * h * (nope + v) + h * v * H)
    if kind == "linear_attention":
        nk, nv = t.linear_num_key_heads, t.linear_num_value_heads
        dk, dv = t.linear_key_head_dim, t.linear_value_head_dim
        return 2 * H * (2 * nk * dk + 2 * nv * dv + 2 * nv) + 2 * nv * dv * H
    h, g = t.num_attention_heads, t.num_key_value_heads
    hd = getattr(t, "head_dim", None) or H // h
    q = h * hd * (2 if t.model_type in GATED_ATTENTION_MODEL_TYPES else 1)
    return 2 * (H * q + 2 * H * g * hd + h * hd * H)


def attention_width(t) -> float:
    """The head width in 4 * heads * width FLOPs per (query, key) pair: head_dim; for latent
    attention the mean of the keys' (nope + rope) and the values' widths."""
    if getattr(t, "kv_lora_rank", None):
        return (t.qk_nope_head_dim + t.qk_rope_head_dim + t.v_head_dim) / 2
    return getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads


def layer_types(t) -> list[str]:
    return list(getattr(t, "layer_types", None) or ["full_attention"] * t.num_hidden_layers)


def causal_pairs_per_layer(t, doc_len: float, layers: int) -> float:
    """(query, key) pairs one document of `doc_len` tokens attends over, summed over the first
    `layers` layers: doc_len (doc_len + 1) / 2 for full attention, fewer in a sliding window."""
    L, W = int(doc_len), getattr(t, "sliding_window", None)
    full = L * (L + 1) / 2
    windowed = full if not W or W >= L else W * (W + 1) / 2 + (L - W) * W
    pairs = {"sliding_attention": windowed, "linear_attention": 0.0}  # a recurrence has no pairs
    return sum(pairs.get(kind, full) for kind in layer_types(t)[:layers])


def step_flops(cfg, preset: str) -> dict:
    t = preset_config(f"preset:{preset}")
    H, V, L = t.hidden_size, t.vocab_size, t.num_hidden_layers
    h, g = t.num_attention_heads, t.num_key_value_heads
    hd = getattr(t, "head_dim", None) or H // h
    inter = getattr(t, "intermediate_size", None) or 4 * H  # (the drafter's default where the target has none)
    S = cfg.data.plan.token_budget
    Ld = min(_doc_length(cfg.data.path), S)
    B, N = cfg.drafter.block_size, cfg.step.num_anchors
    taps = cfg.drafter.target_layer_ids or default_target_layer_ids(L, cfg.drafter.num_taps)
    n_taps = len(taps)
    W = cfg.drafter.sliding_window
    d_inter = cfg.drafter.intermediate_size or inter
    D_layers = cfg.drafter.num_layers

    layers_run = L if cfg.step.label_source != "data" else max(taps) + 1
    # per token: every decoder matmul of the layers run (what FP8 runs)
    target_linear = sum(attention_flops_per_token(t, kind) + mlp_flops_per_token(t, i)
                        for i, kind in enumerate(layer_types(t)[:layers_run]))
    docs = max(1, int(S // Ld))
    # (query, key) pairs of causal attention per row, over the layers run
    causal_pairs = docs * causal_pairs_per_layer(t, Ld, layers_run)
    target = S * target_linear + 4 * h * attention_width(t) * causal_pairs
    candidates = docs * (Ld - Ld // 4 - 1)  # synthetic documents: the first quarter is the prompt
    anchors = min(N, candidates)
    if cfg.step.label_source != "data":
        per_doc = candidates // docs
        target += docs * expected_label_rows(per_doc, -(-anchors // docs), B) * 2 * H * V

    # average visible context keys of a query: anchors uniform over a document's candidates
    p = np.arange(Ld // 4 - 1, Ld - 1, dtype=np.float64)  # anchor offsets within the document
    k = np.arange(B, dtype=np.float64)
    vis = p[:, None] if not W else np.minimum(p[:, None], np.maximum(W - k[None, :], 0))
    ctx_keys = float(vis.mean())
    causal = W is not None  # sliding layers are causal within the block by default
    blk_keys = (B + 1) / 2 if causal else B
    Q = anchors * B
    d_qkv = 2 * (H * h * hd + 2 * H * g * hd)
    d_layer_linear = d_qkv + 2 * (h * hd * H + 3 * H * d_inter)
    drafter_fwd = (S * 2 * n_taps * H * H  # fc over the context
                   + D_layers * (S * 2 * H * 2 * g * hd  # context K/V of each layer
                                 + Q * d_layer_linear
                                 + Q * 4 * h * hd * (ctx_keys + blk_keys))
                   - (Q - anchors - 1) * d_qkv)  # the first layer projects one mask row per row, not N*(B-1)
    head = anchors * (B - 1) * 2 * H * V * 2  # logits + the cross-entropy gradient through W
    parts = {"target": target / S, "drafter_fwd": drafter_fwd / S, "drafter_bwd": 2 * drafter_fwd / S,
             "lm_head_ce": head / S}
    return {"per_token": sum(parts.values()), "parts": parts, "visible_context_keys": ctx_keys,
            "target_linear": target_linear}  # per token: the decoder matmuls (what FP8 runs)


def _median_seconds(fn, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return sorted(times)[len(times) // 2]


def matmul_peaks_tflops(device, fp8: bool = False) -> dict[str, float] | None:
    """Measured dense matmul rates of this device (8192^3, median of 10), TFLOP/s: bf16, and
    with `fp8` also float8 through the target's own row-scaled kernel (`fp8_matmul`)."""
    if device.type != "cuda":
        return None
    torch.cuda.set_device(device)  # the events time the current device's stream
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    flop = 2 * 8192**3
    peaks = {"bf16": flop / _median_seconds(lambda: a @ b) / 1e12}
    if fp8:
        (a8, sa), (b8, sb) = quantize_rows(a), quantize_rows(b)
        sb = sb.t().contiguous()
        peaks["fp8"] = flop / _median_seconds(lambda: fp8_matmul(a8, sa, b8, sb, None, torch.bfloat16)) / 1e12
    return peaks


def best_peaks(*measured: dict[str, float] | None) -> dict[str, float] | None:
    """Per kind (bf16, fp8), the best of several measurements of the matmul peaks; None where none
    was measured (a CPU). A GPU's clocks may sit lower for a while after a long, heavy run (one
    H100: 678-789 bf16 TFLOP/s measured after Gemma-3-27B runs, 787-791 after qwen3-8b's), and a
    peak measured then would flatter the MFU: the best of one before and one after the run does not."""
    best: dict[str, float] = {}
    for peaks in measured:
        for kind, tflops in (peaks or {}).items():
            best[kind] = max(best.get(kind, 0.0), tflops)
    return best or None


def model_flops_utilisation(flops: dict, tokens_per_s_per_gpu: float, peaks: dict[str, float] | None) -> float | None:
    """The time the step's counted FLOPs would take at the measured peaks, over the time it
    took: float8 target matmuls (when measured with FP8) at the float8 peak, the rest at the
    bf16 peak. Without FP8 this is achieved TFLOP/s over the bf16 peak."""
    if not peaks:
        return None
    fp8 = flops["target_linear"] if "fp8" in peaks else 0.0
    ideal_s_per_token = (fp8 / (peaks["fp8"] * 1e12) if fp8 else 0.0) + (flops["per_token"] - fp8) / (peaks["bf16"] * 1e12)
    return ideal_s_per_token * tokens_per_s_per_gpu
