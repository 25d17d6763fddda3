"""The static decoder for hybrid stacks (Qwen3-Next, Qwen3.5 dense and MoE): most layers mix tokens
by gated delta-rule linear attention, every few a gated full attention.

The attention layers are the base decoder's (generate/decoder.py: KV cache, masks, kernels) with
the hybrid's own layer functions (target/packed_hybrid.py: zero-centred norms, the output gate,
RoPE over part of a head); the linear-attention layers keep a per-slot state that rolls back by
position like the cache (generate/linear_state.py). `decode` is `verify` of one token: every
call, whatever its width, replays the tokens a slot accepted since the last one first.

    k/v caches   [attention layers, slots, kv_heads, max_len, head_dim]
    states       per linear layer: [slots, Hv, dk, dv] float32 and a ring of W + K - 1 inputs
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from dflash_train.generate.attention import AttentionKind, cache_index, masked_attention, write_cache
from dflash_train.generate.decoder import StaticDecoder
from dflash_train.generate.linear_state import LinearMixerWeights, LinearStates, linear_mixer
from dflash_train.target.language_model import text_config
from dflash_train.target.ops import repeat_kv
from dflash_train.target.packed_hybrid import (HYBRID_MODEL_TYPES, HybridLayerWeights, gated_qkv,
                                               post_attention_hybrid, post_mixer_hybrid, zero_centred_norm)


def gated_q_writing_kv(x: Tensor, cos: Tensor, sin: Tensor, *pre: Tensor, k_flat: Tensor, v_flat: Tensor,
                       index: Tensor, **options) -> tuple[Tensor, Tensor]:
    """`gated_qkv` that writes k/v into the cache (flat views, at `index`) and returns q and the gate."""
    q, k, v, gate = gated_qkv(x, cos, sin, *pre, **options)
    write_cache(k_flat, index, k)
    write_cache(v_flat, index, v)
    return q, gate


class HybridDecoder(StaticDecoder):
    """StaticDecoder for a hybrid stack: `slots` sequences of at most `max_len` tokens, verified in
    blocks of at most `width` (which sizes the linear layers' rings)."""

    def __init__(self, model, slots: int, max_len: int, attention: AttentionKind = "dense", width: int = 1) -> None:
        super().__init__(model, slots, max_len, attention=attention, width=width)
        self.slot_of: list[int] = []  # each layer's index among the attention layers, or among the linear ones
        seen = {True: 0, False: 0}
        for lay in self.stack:
            self.slot_of.append(seen[lay.mixer is None])
            seen[lay.mixer is None] += 1
        self.mixers = [LinearMixerWeights(lay.mixer) for lay in self.stack if lay.mixer is not None]
        self.states = LinearStates(self.mixers, slots, width, self.dtype, self.device)
        self.q_writing_kv = gated_q_writing_kv
        self.post_attention = post_attention_hybrid
        self.post_mixer = post_mixer_hybrid
        self.linear_mixer = linear_mixer

    def _attention_layers(self, inner, cfg) -> list:
        self.stack = [HybridLayerWeights(layer) for layer in inner.layers]  # every layer, in order
        return [lay for lay in self.stack if lay.mixer is None]

    def verify_functions(self) -> tuple[str, ...]:
        return "q_writing_kv", "post_attention", "linear_mixer", "post_mixer", "final_logits"

    def decode_functions(self) -> tuple[str, ...]:
        return self.verify_functions()  # `decode` is `verify` of one token

    def kv_bytes(self) -> int:
        return super().kv_bytes() + self.states.nbytes()

    def _qkv_kw(self, lay: HybridLayerWeights) -> dict:
        return {**lay.pre_kwargs, "n_heads": self.n_heads, "n_kv": self.n_kv, "head_dim": self.head_dim}

    def _prefill(
        self, ids: Tensor, lengths: Tensor, slot_ids: Tensor, tap_layers: Sequence[int]
    ) -> tuple[Tensor, Tensor | None]:
        b, t = ids.shape
        x = self._embed(ids)
        cos, sin = (table[:t, None, :] for table in self.ropes[None])  # [T, 1, D] over [B, T, heads, D]
        taps: dict[int, Tensor] = {}
        for i, lay in enumerate(self.stack):
            j = self.slot_of[i]
            if lay.mixer is not None:
                h = zero_centred_norm(x, lay.ln1_w, lay.ln1_eps)
                x = post_mixer_hybrid(x, self.states.prefill(j, self.mixers[j], h, lengths, slot_ids), *lay.post,
                                      **lay.post_kwargs)
            else:
                q, k, v, gate = gated_qkv(x, cos, sin, *lay.pre, **self._qkv_kw(lay))
                self._write_prompts(j, k.transpose(1, 2), v.transpose(1, 2), lengths, slot_ids)  # [B, kv, T, D]
                k, v = repeat_kv(k, v, self.n_heads)
                o = masked_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, scale=self.scale)
                x = post_attention_hybrid(x, o.transpose(1, 2).reshape(b, t, -1), gate, *lay.post, **lay.post_kwargs)
            if i in tap_layers:
                taps[i] = x
        self.states.done[slot_ids.to(self.device)] = lengths.to(self.device)
        last = x[torch.arange(b, device=x.device), lengths - 1]
        return self._logits(last), self._concat_taps(taps, tap_layers)

    def decode(self, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        return self.verify(tokens[:, None], positions, kv_len)[0][:, 0]

    def verify(
        self, tokens: Tensor, positions: Tensor, kv_len: int, tap_layers: Sequence[int] = (),
        taps_out: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """StaticDecoder.verify: T tokens for every slot at positions[s] + 0..T-1, T <= `width`."""
        s, t = tokens.shape
        if t > self.width:
            raise ValueError(f"verify of {t} tokens a slot: this decoder's linear layers replay blocks of up to "
                             f"{self.width} (HybridDecoder(width=...))")
        grid = positions[:, None] + self.key_positions[None, :t]  # [S, T] each token's position
        x = self._embed(tokens)  # [S, T, H]
        cos, sin = (table[grid][:, :, None, :] for table in self.ropes[None])  # [S, T, 1, D]
        attention = self._attention(s, t, None, self.max_len)
        attention.prepare(positions, kv_len)
        index = cache_index(self.rows[:s], grid, self.n_kv, self.max_len)
        taps: dict[int, Tensor] = {}
        for i, lay in enumerate(self.stack):
            j = self.slot_of[i]
            if lay.mixer is not None:
                h, mix = zero_centred_norm(x, lay.ln1_w, lay.ln1_eps), self.mixers[j]
                state, ring = self.states.states[j][:s], self.states.rings[j][:s]
                mixed = self.linear_mixer(h, positions, self.states.done[:s], ring, state, *mix.tensors, **mix.dims)
                x = self.post_mixer(x, mixed, *lay.post, **lay.post_kwargs)
            else:
                q, gate = self.q_writing_kv(x, cos, sin, *lay.pre, k_flat=self.k_flat[j], v_flat=self.v_flat[j],
                                            index=index, **self._qkv_kw(lay))
                attn = attention.attend(q, self.k_layers[j], self.v_layers[j])
                x = self.post_attention(x, attn, gate, *lay.post, **lay.post_kwargs)
            if i in tap_layers:
                taps[i] = x
        self.states.done[:s] = positions
        return self.final_logits(x, self.norm_w, self.lm_head_w, self.lm_head_b, **self.logits_kw), \
            self._concat_taps(taps, tap_layers, taps_out)


def static_decoder(model, slots: int, max_len: int, attention: AttentionKind = "dense",
                   width: int = 1) -> StaticDecoder:
    """The static decoder for `model`: HybridDecoder for a hybrid stack, else StaticDecoder."""
    if text_config(model.config).model_type in HYBRID_MODEL_TYPES:
        return HybridDecoder(model, slots, max_len, attention=attention, width=width)
    return StaticDecoder(model, slots, max_len, attention=attention, width=width)
