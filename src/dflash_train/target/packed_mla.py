"""Multi-head latent attention (DeepSeek-V3 and R1's `deepseek_v3`, GLM-4.7-Flash's
`glm4_moe_lite`) in the packed target forward (target/packed.py).

Per token, as the model computes it:

    q           q_b(norm(q_a(h)))  (q_proj(h) where the model has no query rank)   [R, S, heads, nope + rope]
    c, k_rot    kv_a(h) split into the latent [kv_rank] and one shared rotary key [rope]
    k_nope, v   kv_b(norm(c)) per head: [nope] and [v_dim]
    RoPE        over q's and k's last `rope` dims: in interleaved pairs (DeepSeek's `rope_interleave`)
                or in halves; k_rot is shared by every head

Keys are nope + rope wide and values v_dim wide. Values are padded with zeros to the keys' width,
so that every attention kernel takes them (SDPA's flash kernel and FlexAttention want one head
width); the padding adds zero columns to the output, cut off before the output projection. The
MLP is the same as GLM-4.5's: dense first layers, then the sigmoid-routed experts with shared
experts (target/moe.py), so `post_attention_mla` hands over to packed.py's functions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.target.ops import apply_rope, rms_norm
from dflash_train.target.projections import Projection, project, projection_of

MLA_MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite")


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE over pairs (x0, x1), (x2, x3), ... each turned by one frequency, the turned evens then
    the turned odds, as transformers computes DeepSeek's `rope_interleave`; `cos`/`sin` are the
    model's tables (each frequency twice: the first half is read)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def queries_and_latent(
    x: Tensor, ln1_w: Tensor, q_a: Projection | None, q_a_norm_w: Tensor | None, q_b: Projection, kv_a: Projection,
    kv_a_norm_w: Tensor, *, eps: float, q_eps: float, kv_eps: float, n_heads: int, nope: int, rope: int,
    kv_rank: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """x [..., H] -> q_nope [..., heads, nope], q_rot [..., heads, rope] (not rotated yet), the normed
    latent [..., kv_rank] and the shared rotary key [..., rope]: what both forms of the attention
    compute first. `q_a` None: `q_b` is the model's q_proj."""
    h = rms_norm(x, ln1_w, eps)
    q_in = h if q_a is None else rms_norm(project(h, (q_a,))[0], q_a_norm_w, q_eps)
    q = project(q_in, (q_b,))[0].view(*h.shape[:-1], n_heads, nope + rope)
    latent, k_rot = project(h, (kv_a,))[0].split([kv_rank, rope], dim=-1)
    return (*q.split([nope, rope], dim=-1), rms_norm(latent, kv_a_norm_w, kv_eps), k_rot)


def pre_attention_mla(
    x: Tensor, cos: Tensor, sin: Tensor, ln1_w: Tensor, q_a: Projection | None, q_a_norm_w: Tensor | None,
    q_b: Projection, kv_a: Projection, kv_a_norm_w: Tensor, kv_b: Projection, *, eps: float, q_eps: float,
    kv_eps: float, n_heads: int, n_kv: int, head_dim: int, nope: int, v_dim: int, kv_rank: int, interleave: bool,
    grouped_kv: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """x [R, S, H] -> q, k [R, S, heads, head_dim] (head_dim = nope + rope), v the same width (zeros
    past v_dim). `cos`/`sin` [R, S, 1, rope]. (`n_kv`, `grouped_kv`: every head has its own keys here.)"""
    R, S = x.shape[:2]
    rope = head_dim - nope
    q_nope, q_rot, c, k_rot = queries_and_latent(x, ln1_w, q_a, q_a_norm_w, q_b, kv_a, kv_a_norm_w, eps=eps,
                                                 q_eps=q_eps, kv_eps=kv_eps, n_heads=n_heads, nope=nope, rope=rope,
                                                 kv_rank=kv_rank)
    k_nope, v = project(c, (kv_b,))[0].view(R, S, n_heads, nope + v_dim).split([nope, v_dim], dim=-1)
    rotate = rope_interleaved if interleave else apply_rope
    q = torch.cat([q_nope, rotate(q_rot, cos, sin)], dim=-1)
    k = torch.cat([k_nope, rotate(k_rot[:, :, None, :], cos, sin).expand(R, S, n_heads, rope)], dim=-1)
    return q, k, F.pad(v, (0, head_dim - v_dim))


def values_only(attn_out: Tensor, n_heads: int, v_dim: int) -> Tensor:
    """[R, S, heads * head_dim] attention output of zero-padded values -> [R, S, heads * v_dim]."""
    R, S = attn_out.shape[:2]
    return attn_out.view(R, S, n_heads, -1)[..., :v_dim].reshape(R, S, n_heads * v_dim)


def mla_attention_weights(layer: nn.Module, eps: float) -> tuple[tuple, dict]:
    """One MLA layer's `pre_attention_mla` arguments and options (references, no copies)."""
    attn = layer.self_attn
    low_rank_q = getattr(attn, "q_a_proj", None) is not None
    q_a_norm = attn.q_a_layernorm if low_rank_q else None
    pre = (layer.input_layernorm.weight, projection_of(attn.q_a_proj) if low_rank_q else None,
           q_a_norm.weight if q_a_norm is not None else None,
           projection_of(attn.q_b_proj if low_rank_q else attn.q_proj), projection_of(attn.kv_a_proj_with_mqa),
           attn.kv_a_layernorm.weight, projection_of(attn.kv_b_proj))
    options = {"eps": eps, "q_eps": _eps(q_a_norm) if q_a_norm is not None else 0.0,
               "kv_eps": _eps(attn.kv_a_layernorm), "nope": int(attn.qk_nope_head_dim),
               "v_dim": int(attn.v_head_dim), "kv_rank": int(attn.kv_lora_rank),
               "interleave": bool(getattr(attn.config, "rope_interleave", False))}
    return pre, options


def latent_weights(layer: nn.Module, eps: float) -> tuple[tuple, dict]:
    """One latent-attention layer's `latent_qkv` arguments and options: `mla_attention_weights`'s
    with W_uk in place of kv_b_proj (references, no copies)."""
    pre, options = mla_attention_weights(layer, eps)
    return (*pre[:-1], up_projections(layer.self_attn)[0]), {k: v for k, v in options.items() if k != "v_dim"}


def _eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


# --- the decoding engines' form (generate/layers.py): the latent cached, the up-projections absorbed ---
#
# A cache of every head's keys and values would hold heads * (nope + rope + v_dim) numbers a token
# and layer (DeepSeek-V3: 49,152); the engines cache what the model computes once a token, the
# normed latent c [kv_rank] and the rotary key [rope] (576). Since k_nope = W_uk c and v = W_uv c
# per head, q_nope . k_nope = (q_nope W_uk) . c and softmax(..) v = W_uv (softmax(..) c): each head
# attends in latent space to one shared head [c, k_rot] (GQA with one kv head) with the query
# [q_nope W_uk, q_rot], and its output goes through W_uv before o_proj. The same numbers as the
# model's own forward up to rounding.


def latent_head_dim(config) -> int:
    """The width of the engines' one cached head of a latent-attention model (its attention module
    or text config, both name them alike): kv_rank + rope."""
    return int(config.kv_lora_rank) + int(config.qk_rope_head_dim)


def up_projections(attn: nn.Module) -> tuple[Tensor, Tensor]:
    """kv_b_proj's weight as (W_uk [heads, nope, kv_rank], W_uv [heads, v_dim, kv_rank]), views."""
    heads, nope, v_dim = int(attn.config.num_attention_heads), int(attn.qk_nope_head_dim), int(attn.v_head_dim)
    w = attn.kv_b_proj.weight.view(heads, nope + v_dim, -1)
    return w[:, :nope], w[:, nope:]


def latent_qkv(
    x: Tensor, cos: Tensor, sin: Tensor, ln1_w: Tensor, q_a: Projection | None, q_a_norm_w: Tensor | None,
    q_b: Projection, kv_a: Projection, kv_a_norm_w: Tensor, w_uk: Tensor, *, eps: float, q_eps: float,
    kv_eps: float, n_heads: int, head_dim: int, nope: int, kv_rank: int, interleave: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """x [..., H] -> q [..., heads, head_dim], k and v [..., 1, head_dim] (head_dim = kv_rank + rope;
    v is the normed latent, zero past kv_rank). `cos`/`sin` broadcast against [..., heads, rope]."""
    rope = head_dim - kv_rank
    q_nope, q_rot, c, k_rot = queries_and_latent(x, ln1_w, q_a, q_a_norm_w, q_b, kv_a, kv_a_norm_w, eps=eps,
                                                 q_eps=q_eps, kv_eps=kv_eps, n_heads=n_heads, nope=nope, rope=rope,
                                                 kv_rank=kv_rank)
    c = c[..., None, :]  # [..., 1, kv_rank]
    rotate = rope_interleaved if interleave else apply_rope
    q = torch.cat([torch.einsum("...hn,hnc->...hc", q_nope, w_uk), rotate(q_rot, cos, sin)], dim=-1)
    k = torch.cat([c, rotate(k_rot[..., None, :], cos, sin)], dim=-1)
    return q, k, F.pad(c, (0, rope))


def latent_output(attn_out: Tensor, w_uv: Tensor) -> Tensor:
    """[..., heads * head_dim] attention output in latent space -> [..., heads * v_dim]: each head's
    first kv_rank numbers through its W_uv."""
    heads, _, kv_rank = w_uv.shape
    o = attn_out.view(*attn_out.shape[:-1], heads, -1)[..., :kv_rank]
    return torch.einsum("...hc,hvc->...hv", o, w_uv).flatten(-2)
