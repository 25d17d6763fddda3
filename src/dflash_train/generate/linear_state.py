"""Gated delta-rule linear attention (Qwen3-Next, Qwen3.5) in the static decoder, its per-slot
state rolled back by position as the KV cache is.

A linear-attention layer remembers, per slot, a recurrent state [Hv, dk, dv] and the last K - 1
inputs of its short causal convolution (K its kernel). The engines roll a rejected draft back by
position alone, so no call moves the state past its own tokens: each slot's state holds the
tokens before `done[slot]`, and a call at position P first replays the tokens [done, P) from a
ring of their projected inputs (only accepted tokens lie below P), then runs its own tokens from
there, writing their inputs into the ring:

    ring   per layer [slots, R, conv_dim + 2 Hv]   by position mod R: the convolution's input, b, a
    state  per layer [slots, Hv, dk, dv] float32   the recurrence after the tokens before done[slot]
    done   [slots]                                 shared by the layers

Calls of at most W tokens move P by at most W, so the replay is a block of W tokens, masked past
each slot's P (a fixed shape: a CUDA graph captures it), and a ring of W + K - 1 positions holds
every input a call reads. A block, replayed or new, runs the rule in closed form (`block_rule`):
decoding is bound by reading the states, and a block reads each once (twice more to update it),
whatever its length. The convolution and the gated norm repeat transformers' op sequence; a prompt
runs through the module's chunked kernel (flash-linear-attention's when installed), its padding
masked out of the state.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _qwen3_next_order(mixer: nn.Module) -> tuple[Tensor, Tensor]:
    """Column orders turning Qwen3-Next's fused projections (per key head: q, k, v, z; b, a) into
    Qwen3.5's layout (q of every head, then k, v, z; b, then a)."""
    nk, dk, dv = mixer.num_k_heads, mixer.head_k_dim, mixer.head_v_dim
    r = mixer.num_v_heads // nk
    group = 2 * dk + 2 * r * dv
    parts = [(0, dk), (dk, dk), (2 * dk, r * dv), (2 * dk + r * dv, r * dv)]  # q, k, v, z within a group
    qkvz = torch.cat([g * group + start + torch.arange(n) for start, n in parts for g in range(nk)])
    ba = torch.cat([g * 2 * r + start + torch.arange(r) for start in (0, r) for g in range(nk)])
    return qkvz, ba


class LinearMixerWeights:
    """One linear-attention module's weights (references; Qwen3-Next's fused projections read
    through a column order) and shapes."""

    def __init__(self, mixer: nn.Module) -> None:
        self.mixer = mixer
        self.nk, self.nv = mixer.num_k_heads, mixer.num_v_heads
        self.dk, self.dv, self.kernel = mixer.head_k_dim, mixer.head_v_dim, mixer.conv_kernel_size
        self.conv_dim = 2 * self.nk * self.dk + self.nv * self.dv
        self.conv_w = mixer.conv1d.weight  # [C, 1, K]
        self.conv_b = mixer.conv1d.bias
        self.a_log, self.dt_bias = mixer.A_log, mixer.dt_bias
        self.norm_w, self.norm_eps = mixer.norm.weight, float(mixer.norm.variance_epsilon)
        self.out_w = mixer.out_proj.weight
        self.order = None
        if hasattr(mixer, "in_proj_qkvz"):  # Qwen3-Next
            self.order = tuple(o.to(self.out_w.device) for o in _qwen3_next_order(mixer))
        # the module's chunked kernel for whole prompts (flash-linear-attention's when installed)
        self.chunk_rule = sys.modules[type(mixer).__module__].torch_chunk_gated_delta_rule

    def project(self, h: Tensor) -> tuple[Tensor, Tensor]:
        """h [..., H] -> the ring's row [..., conv_dim + 2 Hv] (convolution input, b, a) and z [..., Hv*dv]."""
        m = self.mixer
        if self.order is None:
            mixed, z = F.linear(h, m.in_proj_qkv.weight), F.linear(h, m.in_proj_z.weight)
            b, a = F.linear(h, m.in_proj_b.weight), F.linear(h, m.in_proj_a.weight)
            return torch.cat([mixed, b, a], dim=-1), z
        qkvz = F.linear(h, m.in_proj_qkvz.weight)[..., self.order[0]]
        ba = F.linear(h, m.in_proj_ba.weight)[..., self.order[1]]
        return torch.cat([qkvz[..., :self.conv_dim], ba], dim=-1), qkvz[..., self.conv_dim:]

    def convolve(self, rows: Tensor, count: int) -> Tensor:
        """The convolution's outputs [S, count, C] at the last `count` of `rows` [S, count + K - 1, ...]
        (each output reads its K - 1 predecessors), as causal_conv1d_update computes them."""
        x = rows[..., :self.conv_dim].transpose(1, 2)
        out = F.conv1d(x.to(self.conv_w.dtype), self.conv_w, self.conv_b, groups=self.conv_dim)
        return F.silu(out[:, :, -count:]).to(rows.dtype).transpose(1, 2)

    def heads(self, conv: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """q, k [S, T, nk, dk], v [S, T, nv, dv], g and beta [S, T, nv] (float32 g) from the convolution's
        outputs and the rows' b and a, as the module computes them."""
        lead = conv.shape[:-1]
        q, k, v = conv.split([self.nk * self.dk, self.nk * self.dk, self.nv * self.dv], dim=-1)
        b, a = rows[..., self.conv_dim:self.conv_dim + self.nv], rows[..., self.conv_dim + self.nv:]
        g = -self.a_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        return (q.reshape(*lead, self.nk, self.dk), k.reshape(*lead, self.nk, self.dk),
                v.reshape(*lead, self.nv, self.dv), g, b.sigmoid())

    def recurrence_inputs(self, q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor):
        """As torch_recurrent_gated_delta_rule prepares them: heads repeated to the value heads,
        float32, q and k L2-normed, q scaled by dk ** -0.5 (q None: a replay needs none)."""
        rep = self.nv // self.nk
        k = l2norm(k.repeat_interleave(rep, dim=-2).float())
        if q is not None:
            q = l2norm(q.repeat_interleave(rep, dim=-2).float()) / (self.dk ** 0.5)
        return q, k, v.float(), g.float(), beta.float()

    def output(self, core: Tensor, z: Tensor) -> Tensor:
        """The recurrence's output [..., nv, dv] through the gated RMSNorm (z the gate) and out_proj."""
        dtype = core.dtype
        x = core.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        x = self.norm_w * x.to(dtype)
        x = (x * F.silu(z.view(core.shape).float())).to(dtype)
        return F.linear(x.flatten(-2), self.out_w)


def mixer_layout_problem(mixer: nn.Module) -> str | None:
    """Why `LinearMixerWeights` cannot read this linear-attention module, or None."""
    fused = all(hasattr(mixer, n) for n in ("in_proj_qkvz", "in_proj_ba"))
    split = all(hasattr(mixer, n) for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    if not (fused or split):
        return "a linear-attention layer laid out other than Qwen3-Next's or Qwen3.5's"
    if getattr(mixer, "activation", "silu") not in ("silu", "swish"):
        return f"linear-attention activation {mixer.activation!r} (only silu)"
    return None


def state_bytes_per_slot(cfg, width: int, dtype: torch.dtype) -> int:
    """One slot's linear-attention memory in a hybrid config (LinearStates): each linear layer's
    float32 state and its ring of width + K - 1 projected inputs."""
    nk, nv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
    dk, dv, kernel = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim), int(cfg.linear_conv_kernel_dim)
    ring = (width + kernel - 1) * (2 * nk * dk + nv * dv + 2 * nv) * torch.empty((), dtype=dtype).element_size()
    layers = sum(t == "linear_attention" for t in cfg.layer_types[:int(cfg.num_hidden_layers)])
    return layers * (nv * dk * dv * 4 + ring)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def block_rule(state: Tensor, q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor):
    """The gated delta rule over T tokens from `state` [S, Hv, dk, dv] in closed form, one read of the
    state (q/k [S, T, Hv, dk], v [S, T, Hv, dv], g/beta [S, T, Hv], float32, prepared). Step t decays
    the state by e_t = exp(g_t) and adds k_t d_t^T, d_t = beta_t (v_t - e_t s_{t-1}^T k_t). With
    r[t, i] the decay from token i to t, every d solves one unit lower-triangular system,

        d_t + beta_t sum_{i<t} r[t, i] (k_t . k_i) d_i = beta_t (v_t - r[t, 0-] s^T k_t),

    so the outputs s_t^T q_t and the state after the block, r[T, 0-] s + sum_i r[T, i] k_i d_i^T,
    follow by small matmuls (the chunked algorithm's, for one chunk). g = beta = 0 at a token makes
    its d zero: it changes nothing. Returns the outputs [S, T, Hv, dv] (None without q) and the
    block's decay [S, Hv], weighted keys [S, Hv, dk, T] and d [S, Hv, T, dv] (`advance_`)."""
    k, v, g, beta = (x.transpose(1, 2) for x in (k, v, g, beta))  # [S, Hv, T, ...]
    t = k.shape[-2]
    c = g.cumsum(-1)  # log of the decay since the block began
    causal = torch.ones(t, t, dtype=torch.bool, device=k.device).tril()
    decay = torch.where(causal, c[..., :, None] - c[..., None, :], float("-inf")).exp()  # r[t, i], i <= t
    reads = (k if q is None else torch.cat([k, q.transpose(1, 2)], dim=-2)) @ state  # s^T k_t (and s^T q_t)
    rhs = beta[..., None] * (v - c.exp()[..., None] * reads[..., :t, :])
    mix = beta[..., :, None] * decay * (k @ k.transpose(-1, -2))  # (its strict lower triangle is read)
    d = rhs.clone()  # forward substitution: T - 1 small steps, plain ops a CUDA graph captures
    for i in range(1, t):
        d[..., i, :] -= (mix[..., i, :i, None] * d[..., :i, :]).sum(-2)
    out = None
    if q is not None:
        qk = decay * (q.transpose(1, 2) @ k.transpose(-1, -2))
        out = (c.exp()[..., None] * reads[..., t:, :] + qk @ d).transpose(1, 2)
    return out, c[..., -1].exp(), (k * decay[..., -1, :, None]).transpose(-1, -2), d


def advance_(state: Tensor, decay: Tensor, keys: Tensor, d: Tensor) -> None:
    """state <- decay state + keys d (`block_rule`'s pieces), in place: one pass to scale, one to add."""
    s, h, dk, dv = state.shape
    state.mul_(decay[..., None, None])
    state.view(s * h, dk, dv).baddbmm_(keys.reshape(s * h, dk, -1), d.reshape(s * h, -1, dv))


class LinearStates:
    """Every linear-attention layer's ring and state for `slots` slots, and `done` (module docstring)."""

    def __init__(self, layers: list[LinearMixerWeights], slots: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.width = width
        self.ring_len = width + max(lay.kernel for lay in layers) - 1
        self.rings = [torch.zeros(slots, self.ring_len, lay.conv_dim + 2 * lay.nv, dtype=dtype, device=device)
                      for lay in layers]
        self.states = [torch.zeros(slots, lay.nv, lay.dk, lay.dv, dtype=torch.float32, device=device)
                       for lay in layers]
        self.done = torch.zeros(slots, dtype=torch.long, device=device)
        self.offsets = torch.arange(self.ring_len + width, device=device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.rings, *self.states))

    def _rows(self, j: int, first: Tensor, count: int) -> Tensor:
        """Layer j's ring rows [S, count, ...] of positions first[s] + 0..count-1 (zeros before 0)."""
        pos = first[:, None] + self.offsets[None, :count]
        rows = self.rings[j][torch.arange(len(first), device=first.device)[:, None], pos.remainder(self.ring_len)]
        return torch.where((pos >= 0)[..., None], rows, 0.0)

    def catch_up(self, j: int, lay: LinearMixerWeights, positions: Tensor) -> Tensor:
        """Layer j's state [S, ...] of the first S = len(positions) slots after replaying their tokens
        [done, positions) (at most `width` of them), written back."""
        s, context = len(positions), lay.kernel - 1
        done = self.done[:s]
        rows = self._rows(j, done - context, self.width + context)
        _, k, v, g, beta = lay.heads(lay.convolve(rows, self.width), rows[:, context:])
        _, k, v, g, beta = lay.recurrence_inputs(None, k, v, g, beta)
        keep = done[:, None] + self.offsets[None, :self.width] < positions[:, None]
        g, beta = torch.where(keep[..., None], g, 0.0), torch.where(keep[..., None], beta, 0.0)  # the rest: no-ops
        state = self.states[j][:s]
        advance_(state, *block_rule(state, None, k, v, g, beta)[1:])
        return state

    def step(self, j: int, lay: LinearMixerWeights, h: Tensor, positions: Tensor) -> Tensor:
        """Layer j's mixer on tokens at positions[s] + 0..T-1 (h [S, T, H], already normed), its state
        caught up to `positions` first; their inputs go into the ring, the state stays before them."""
        s, t = h.shape[:2]
        state = self.catch_up(j, lay, positions)
        row, z = lay.project(h)
        slots = positions[:, None] + self.offsets[None, :t]
        self.rings[j][torch.arange(s, device=h.device)[:, None], slots.remainder(self.ring_len)] = row
        context = lay.kernel - 1
        rows = self._rows(j, positions - context, t + context)
        q, k, v, g, beta = lay.recurrence_inputs(*lay.heads(lay.convolve(rows, t), rows[:, context:]))
        return lay.output(block_rule(state, q, k, v, g, beta)[0].to(h.dtype), z)

    def prefill(self, j: int, lay: LinearMixerWeights, h: Tensor, lengths: Tensor, slot_ids: Tensor) -> Tensor:
        """Layer j's mixer on right-padded prompts h [B, T, H] into slots `slot_ids`: the chunked kernel
        with the padding's g and beta zeroed (so it leaves the state alone), the state after each
        prompt and its last inputs kept for the slot."""
        b, t = h.shape[:2]
        row, z = lay.project(h)
        conv = F.silu(F.conv1d(row[..., :lay.conv_dim].transpose(1, 2).to(lay.conv_w.dtype), lay.conv_w,
                               lay.conv_b, padding=lay.kernel - 1, groups=lay.conv_dim)[:, :, :t])
        q, k, v, g, beta = lay.heads(conv.to(h.dtype).transpose(1, 2), row)
        real = (torch.arange(t, device=h.device)[None, :] < lengths.to(h.device)[:, None])[..., None]  # [B, T, 1]
        g, beta = torch.where(real, g, 0.0), torch.where(real, beta, 0.0)
        rep = lay.nv // lay.nk  # heads repeated here: older transformers' kernels expect them so
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        core, state = lay.chunk_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
        slot_ids = slot_ids.to(h.device)
        self.states[j][slot_ids] = state.float()
        keep = min(t, self.ring_len)
        first = (lengths.to(h.device) - keep).clamp(min=0)
        grid = first[:, None] + self.offsets[None, :keep]  # each prompt's last positions (all < T)
        self.rings[j][slot_ids[:, None], grid.remainder(self.ring_len)] = row.gather(
            1, grid[..., None].expand(-1, -1, row.shape[-1]))
        return lay.output(core.to(h.dtype), z)
