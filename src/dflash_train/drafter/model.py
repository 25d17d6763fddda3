"""The DFlash drafter: Qwen3-style layers conditioned on the target by KV injection.

Shapes (R rows, S context positions, N blocks of B slots, Q = N*B block tokens,
H hidden, n taps, h heads, g kv heads, d head_dim):

    ctx_raw [R, S, n*H] --fc--> [R, S, H] --hidden_norm--> ctx
    block   [R, Q, H]   (target embedding of [anchor token, MASK, ..., MASK] per block)
    per layer:  q  = q_norm(q_proj(norm(block)))               [R, h, Q, d]
                k  = k_norm(k_proj([ctx ; norm(block)]))       [R, g, S+Q, d]   (RoPE on both)
                v  = v_proj([ctx ; norm(block)])               [R, g, S+Q, d]
    output: norm(block) [R, Q, H]; logits come from the frozen target lm_head (drafter/head_kernel.py).

In training blocks ([anchor token, MASK, ..., MASK]) the first layer's mask rows are one
row: its q/k/v are projected for the N anchors and that row only (`project_blocks`).

The context never passes through q, o or the MLP. The drafter owns no embedding and no
LM head: those are the target's, frozen, and passed in by the caller.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from dflash_train.drafter import dspark
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.masks import AttentionMask, attend
from dflash_train.target.ops import apply_rope, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the result keeps the input's dtype: under bf16 autocast q, k and v then reach the
        # attention kernel in one dtype
        return rms_norm(x, self.weight, self.eps, scale_in_float32=True)


def rope_inverse_frequencies(cfg: DrafterConfig, device: Any = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [d/2], attention_scaling) for the target's RoPE, scaling included."""
    d = cfg.head_dim
    if not cfg.rope_scaling:
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=device) / d))
        return inv.float(), 1.0
    # Scaled variants (llama3, yarn, linear, ...) are delegated to transformers' own
    # implementation so the drafter matches the target bit for bit.
    scaling = dict(cfg.rope_scaling)
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    params = {"rope_theta": cfg.rope_theta, **scaling, "rope_type": rope_type}
    shape = dict(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
    )
    if hasattr(Qwen3Config(), "rope_parameters"):  # transformers >= 5
        hf = Qwen3Config(**shape, rope_parameters=params)
    else:  # transformers 4.x
        hf = Qwen3Config(**shape, rope_theta=cfg.rope_theta, rope_scaling=params)
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, device)
    return inv.float(), float(scale)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        inv, scale = rope_inverse_frequencies(cfg)
        self.register_buffer("inv_freq", inv, persistent=False)
        self.attention_scaling = scale

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [R, T] -> cos, sin [R, 1, T, d] (broadcast over heads)."""
        freqs = positions.float()[..., None] * self.inv_freq  # [R, T, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype)[:, None]
        sin = (emb.sin() * self.attention_scaling).to(dtype)[:, None]
        return cos, sin


def project_blocks(linear: nn.Linear, x: torch.Tensor, mask_block: int | None) -> torch.Tensor:
    """linear(x) for block rows x [R, N*B, H]. With `mask_block` = B, slots 1..B-1 of every
    block hold one same row (the first layer of training blocks: the mask token's embedding,
    normed), so the N anchor rows and that one row are projected and the row is repeated; the
    repeat's backward sums its gradients, which is the gradient of the N*(B-1) copies."""
    if mask_block is None or mask_block < 2:
        return linear(x)
    R, Q, H = x.shape
    N, B = Q // mask_block, mask_block
    blocks = x.view(R, N, B, H)
    anchors = linear(blocks[:, :, 0])  # [R, N, out]
    mask_row = linear(blocks[:, :1, 1])  # [R, 1, out]
    rows = torch.cat([anchors[:, :, None], mask_row[:, :, None].expand(R, N, B - 1, -1)], dim=2)
    return rows.view(R, Q, -1)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, g, d, H = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = h, g, d
        self.q_proj = nn.Linear(H, h * d, bias=False)
        self.k_proj = nn.Linear(H, g * d, bias=False)
        self.v_proj = nn.Linear(H, g * d, bias=False)
        self.o_proj = nn.Linear(h * d, H, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            mask_block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        R, T, _ = x.shape
        k = self.k_norm(project_blocks(self.k_proj, x, mask_block).view(R, T, self.kv_heads, self.head_dim))
        v = project_blocks(self.v_proj, x, mask_block).view(R, T, self.kv_heads, self.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def context_kv(self, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys/values of the injected context [R, S, H] -> ([R, g, S, d], [R, g, S, d]).

        Separate so inference can cache them: context K/V never depend on the block.
        """
        return self._kv(ctx, cos, sin)

    def forward(
        self,
        x: torch.Tensor,  # [R, Q, H] normed block hidden states
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,  # [R, g, S, d]
        ctx_v: torch.Tensor,
        mask: AttentionMask,
        mask_block: int | None = None,  # see project_blocks
    ) -> torch.Tensor:
        R, Q, _ = x.shape
        q = self.q_norm(project_blocks(self.q_proj, x, mask_block).view(R, Q, self.heads, self.head_dim))
        q = apply_rope(q.transpose(1, 2), cos, sin)
        blk_k, blk_v = self._kv(x, cos, sin, mask_block)
        k = torch.cat([ctx_k, blk_k], dim=2)  # key order: context first, then the blocks
        v = torch.cat([ctx_v, blk_v], dim=2)
        out = attend(q, k, v, mask)  # [R, h, Q, d]
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.heads * self.head_dim))


class DrafterMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = DrafterMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask: AttentionMask, mask_block: int | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask, mask_block)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Trainable part of a DFlash drafter (layers, fc, hidden_norm, norm)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.fc = nn.Linear(cfg.num_taps * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg)
        # the dspark variant's bigram head (None otherwise), applied on the logits after forward()
        self.markov_head = dspark.build_head(cfg)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        if self.markov_head is not None:
            self.markov_head.reset_parameters(std)

    def project_context(self, ctx_raw: torch.Tensor, noise_sigma: float = 0.0, generator=None) -> torch.Tensor:
        """ctx_raw [R, S, n*H] (concatenated taps) -> ctx [R, S, H].

        Training-time noise U(-sigma, sigma) is added to the raw taps (spec: "Loss").
        """
        if noise_sigma > 0 and self.training:
            noise = torch.rand(ctx_raw.shape, device=ctx_raw.device, dtype=torch.float32, generator=generator)
            ctx_raw = ctx_raw + ((noise * 2 - 1) * noise_sigma).to(ctx_raw.dtype)
        if not torch.is_autocast_enabled(ctx_raw.device.type):  # autocast casts for the matmul itself
            ctx_raw = ctx_raw.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(ctx_raw))

    def forward(
        self,
        ctx_raw: torch.Tensor,  # [R, S, n*H]
        ctx_positions: torch.Tensor,  # [R, S]
        block_embeds: torch.Tensor,  # [R, Q, H]
        block_positions: torch.Tensor,  # [R, Q]
        masks: list[AttentionMask],  # one per layer (layers of one kind share an object)
        *,
        noise_sigma: float = 0.0,
        generator: torch.Generator | None = None,
        mask_slots: bool = False,
    ) -> torch.Tensor:
        """Final normed hidden states of the block tokens, [R, Q, H]. `mask_slots`: slots 1..B-1
        of every block are the mask token (`block_input_ids`), so the first layer projects them
        once (`project_blocks`)."""
        ctx = self.project_context(ctx_raw, noise_sigma, generator)
        x = block_embeds.to(self.norm.weight.dtype)  # the residual stream in the parameters' dtype
        ctx_cos, ctx_sin = self.rotary(ctx_positions, x.dtype)
        cos, sin = self.rotary(block_positions, x.dtype)
        for i, (layer, mask) in enumerate(zip(self.layers, masks, strict=True)):
            ctx_k, ctx_v = layer.self_attn.context_kv(ctx, ctx_cos, ctx_sin)
            x = layer(x, cos, sin, ctx_k, ctx_v, mask, self.config.block_size if mask_slots and i == 0 else None)
        return self.norm(x)


def block_input_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int) -> torch.Tensor:
    """[R, S] tokens, [R, N] anchors -> [R, N*B] block tokens [x_anchor, MASK, ..., MASK]."""
    R, N = anchors.shape
    ids = torch.full((R, N, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    ids[:, :, 0] = torch.gather(input_ids, 1, anchors)
    return ids.view(R, N * block_size)


def block_positions(position_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Slot k of block j sits at position_ids[a_j] + k. Returns [R, N*B]."""
    R, N = anchors.shape
    base = torch.gather(position_ids, 1, anchors)[..., None]
    return (base + torch.arange(block_size, device=anchors.device)).view(R, N * block_size)
