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
every input a call reads. The replay and the call's own tokens run as one block of the rule in
closed form (`block_rule`): decoding is bound by reading the states, and a call reads each once,
whatever its length, then updates it past the replayed tokens alone (one pass more for a
one-token replay, a decoding step's). The convolution and the gated norm repeat transformers' op
sequence; a prompt runs through the module's chunked kernel (flash-linear-attention's when
installed), its padding masked out of the state.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.target.ops import rms_norm


def conv_width(nk: int, nv: int, dk: int, dv: int) -> int:
    """Channels of the short convolution: q and k of every key head, v of every value head."""
    return 2 * nk * dk + nv * dv


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
    """One linear-attention module's weights as `linear_mixer` takes them (references; Qwen3-Next's
    fused projections with the column orders that read them as Qwen3.5's) and its shapes."""

    def __init__(self, mixer: nn.Module) -> None:
        self.nk, self.nv = mixer.num_k_heads, mixer.num_v_heads
        self.dk, self.dv, self.kernel = mixer.head_k_dim, mixer.head_v_dim, mixer.conv_kernel_size
        self.conv_dim = conv_width(self.nk, self.nv, self.dk, self.dv)
        fused = hasattr(mixer, "in_proj_qkvz")  # Qwen3-Next
        if fused:
            device = mixer.out_proj.weight.device
            proj = (mixer.in_proj_qkvz.weight, mixer.in_proj_ba.weight,
                    *(o.to(device) for o in _qwen3_next_order(mixer)))
        else:
            proj = tuple(getattr(mixer, f"in_proj_{n}").weight for n in ("qkv", "z", "b", "a"))
        # (4 projection tensors, conv weight [C, 1, K] and bias, A_log, dt_bias, norm, out_proj)
        self.tensors = (*proj, mixer.conv1d.weight, mixer.conv1d.bias, mixer.A_log, mixer.dt_bias,
                        mixer.norm.weight, mixer.out_proj.weight)
        self.dims = {"nk": self.nk, "nv": self.nv, "dk": self.dk, "dv": self.dv, "fused": fused,
                     "norm_eps": float(mixer.norm.variance_epsilon)}
        # the module's chunked kernel for whole prompts (flash-linear-attention's when installed)
        self.chunk_rule = sys.modules[type(mixer).__module__].torch_chunk_gated_delta_rule


def project(h: Tensor, p0: Tensor, p1: Tensor, p2: Tensor, p3: Tensor, *, fused: bool,
            conv_dim: int) -> tuple[Tensor, Tensor]:
    """h [..., H] -> the ring's row [..., conv_dim + 2 Hv] (convolution input, b, a) and z [..., Hv*dv]:
    Qwen3.5's four projections, or Qwen3-Next's two read through their column orders p2, p3."""
    if not fused:
        return torch.cat([F.linear(h, p0), F.linear(h, p2), F.linear(h, p3)], dim=-1), F.linear(h, p1)
    qkvz, ba = F.linear(h, p0)[..., p2], F.linear(h, p1)[..., p3]
    return torch.cat([qkvz[..., :conv_dim], ba], dim=-1), qkvz[..., conv_dim:]


def convolve(rows: Tensor, conv_w: Tensor, conv_b: Tensor | None, count: int, conv_dim: int) -> Tensor:
    """The convolution's outputs [S, count, C] at the last `count` of `rows` [S, count + K - 1, ...]
    (each output reads its K - 1 predecessors), as causal_conv1d_update computes them."""
    x = rows[..., :conv_dim].transpose(1, 2)
    out = F.conv1d(x.to(conv_w.dtype), conv_w, conv_b, groups=conv_dim)
    return F.silu(out[:, :, -count:]).to(rows.dtype).transpose(1, 2)


def heads(conv: Tensor, rows: Tensor, a_log: Tensor, dt_bias: Tensor, *, nk: int, nv: int, dk: int, dv: int):
    """q, k [S, T, nk, dk], v [S, T, nv, dv], g and beta [S, T, nv] (float32 g) from the convolution's
    outputs and the rows' b and a, as the module computes them."""
    lead, conv_dim = conv.shape[:-1], conv_width(nk, nv, dk, dv)
    q, k, v = conv.split([nk * dk, nk * dk, nv * dv], dim=-1)
    b, a = rows[..., conv_dim:conv_dim + nv], rows[..., conv_dim + nv:]
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return q.reshape(*lead, nk, dk), k.reshape(*lead, nk, dk), v.reshape(*lead, nv, dv), g, b.sigmoid()


def recurrence_inputs(q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, nv: int):
    """As torch_recurrent_gated_delta_rule prepares them: heads repeated to the value heads,
    float32, q and k L2-normed, q scaled by dk ** -0.5 (q None: a replay needs none)."""
    rep = nv // k.shape[-2]
    k = l2norm(k.repeat_interleave(rep, dim=-2).float())
    if q is not None:
        q = l2norm(q.repeat_interleave(rep, dim=-2).float()) / (q.shape[-1] ** 0.5)
    return q, k, v.float(), g.float(), beta.float()


def gated_output(core: Tensor, z: Tensor, norm_w: Tensor, out_w: Tensor, norm_eps: float) -> Tensor:
    """The recurrence's output [..., nv, dv] through the gated RMSNorm (Llama's norm, then times
    silu(z) in float32) and out_proj."""
    x = (rms_norm(core, norm_w, norm_eps) * F.silu(z.view(core.shape).float())).to(core.dtype)
    return F.linear(x.flatten(-2), out_w)


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
    ring = (width + kernel - 1) * (conv_width(nk, nv, dk, dv) + 2 * nv) * torch.empty((), dtype=dtype).element_size()
    layers = sum(t == "linear_attention" for t in cfg.layer_types[:int(cfg.num_hidden_layers)])
    return layers * (nv * dk * dv * 4 + ring)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def block_rule(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
               advance: int | None = None):
    """The gated delta rule over T tokens from `state` [S, Hv, dk, dv] in closed form, one read of the
    state (k [S, T, Hv, dk], v [S, T, Hv, dv], g/beta [S, T, Hv]; q [S, Tq, Hv, dk] the queries of the
    block's last Tq tokens; float32, prepared). Step t decays the state by e_t = exp(g_t) and adds
    k_t d_t^T, d_t = beta_t (v_t - e_t s_{t-1}^T k_t). With r[t, i] the decay from token i to t,
    every d solves one unit lower-triangular system,

        d_t + beta_t sum_{i<t} r[t, i] (k_t . k_i) d_i = beta_t (v_t - r[t, 0-] s^T k_t),

    so the outputs s_t^T q_t and the state after token n, r[n, 0-] s + sum_{i<=n} r[n, i] k_i d_i^T,
    follow by small matmuls (the chunked algorithm's, for one chunk). g = beta = 0 at a token makes
    its d zero: it changes nothing. Returns the outputs [S, Tq, Hv, dv] and, for
    the state after the first `advance` tokens (all when None), their decay [S, Hv], weighted
    keys [S, Hv, dk, n] and d [S, Hv, n, dv] (`advance_`)."""
    k, v, g, beta = (x.transpose(1, 2) for x in (k, v, g, beta))  # [S, Hv, T, ...]
    t = k.shape[-2]
    n = t if advance is None else advance
    c = g.cumsum(-1)  # log of the decay since the block began
    causal = torch.ones(t, t, dtype=torch.bool, device=k.device).tril()
    decay = torch.where(causal, c[..., :, None] - c[..., None, :], float("-inf")).exp()  # r[t, i], i <= t
    reads = torch.cat([k, q.transpose(1, 2)], dim=-2) @ state  # s^T k_t and s^T q_t
    rhs = beta[..., None] * (v - c.exp()[..., None] * reads[..., :t, :])
    mix = beta[..., :, None] * decay * (k @ k.transpose(-1, -2))  # (its strict lower triangle is read)
    d = rhs.clone()  # forward substitution: T - 1 small steps, plain ops a CUDA graph captures
    for i in range(1, t):
        d[..., i, :] -= (mix[..., i, :i, None] * d[..., :i, :]).sum(-2)
    tq = q.shape[1]
    qk = decay[..., t - tq:, :] * (q.transpose(1, 2) @ k.transpose(-1, -2))  # [S, Hv, Tq, T]
    out = (c[..., t - tq:].exp()[..., None] * reads[..., t:, :] + qk @ d).transpose(1, 2)
    return out, c[..., n - 1].exp(), (k[..., :n, :] * decay[..., n - 1, :n, None]).transpose(-1, -2), d[..., :n, :]


def advance_(state: Tensor, decay: Tensor, keys: Tensor, d: Tensor) -> None:
    """state <- decay state + keys d (`block_rule`'s pieces), in place: one pass to scale, one to add.
    A block of one token (each decoding step's replay) adds an outer product, elementwise: compiled,
    the scale and the add are one pass over the state."""
    s, h, dk, dv = state.shape
    if keys.shape[-1] == 1:
        state.mul_(decay[..., None, None]).addcmul_(keys, d)  # [S, Hv, dk, 1] * [S, Hv, 1, dv]
        return
    state.mul_(decay[..., None, None])
    state.view(s * h, dk, dv).baddbmm_(keys.reshape(s * h, dk, -1), d.reshape(s * h, -1, dv))


def ring_rows(ring: Tensor, first: Tensor, count: int) -> Tensor:
    """A ring's rows [S, count, ...] of positions first[s] + 0..count-1 (zeros before position 0)."""
    pos = first[:, None] + torch.arange(count, device=first.device)[None, :]
    rows = ring[torch.arange(len(first), device=first.device)[:, None], pos.remainder(ring.shape[1])]
    return torch.where((pos >= 0)[..., None], rows, 0.0)


def linear_mixer(h: Tensor, positions: Tensor, done: Tensor, ring: Tensor, state: Tensor, *weights: Tensor | None,
                 nk: int, nv: int, dk: int, dv: int, fused: bool, norm_eps: float) -> Tensor:
    """One linear-attention layer on tokens at positions[s] + 0..T-1 (h [S, T, H], normed), with the
    slots' ring and state (module docstring): the replay from `done` to `positions` (a block of the
    ring's W = R - K + 1 inputs, masked past each slot's own count), then the tokens, their inputs
    written into the ring, run as one block from the state; their outputs come from it, and the
    state moves past the replay alone, so it stays before them.
    Plain tensors in, so a compiled version serves every layer. `weights`: LinearMixerWeights.tensors."""
    p0, p1, p2, p3, conv_w, conv_b, a_log, dt_bias, norm_w, out_w = weights
    s, t = h.shape[:2]
    kernel, conv_dim = conv_w.shape[-1], conv_width(nk, nv, dk, dv)
    width, context = ring.shape[1] - kernel + 1, kernel - 1
    dims = {"nk": nk, "nv": nv, "dk": dk, "dv": dv}
    rows = ring_rows(ring, done - context, width + context)
    _, k, v, g, beta = heads(convolve(rows, conv_w, conv_b, width, conv_dim), rows[:, context:], a_log, dt_bias, **dims)
    _, k, v, g, beta = recurrence_inputs(None, k, v, g, beta, nv=nv)
    keep = (done[:, None] + torch.arange(width, device=h.device)[None, :] < positions[:, None])[..., None]
    replay = k, v, torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0)
    row, z = project(h, p0, p1, p2, p3, fused=fused, conv_dim=conv_dim)
    slots = positions[:, None] + torch.arange(t, device=h.device)[None, :]
    ring[torch.arange(s, device=h.device)[:, None], slots.remainder(ring.shape[1])] = row
    rows = ring_rows(ring, positions - context, t + context)
    q, *own = recurrence_inputs(*heads(convolve(rows, conv_w, conv_b, t, conv_dim), rows[:, context:],
                                       a_log, dt_bias, **dims), nv=nv)
    out, *pieces = block_rule(state, q, *(torch.cat(pair, dim=1) for pair in zip(replay, own)), advance=width)
    advance_(state, *pieces)
    return gated_output(out.to(h.dtype), z, norm_w, out_w, norm_eps)


class LinearStates:
    """Every linear-attention layer's ring and state for `slots` slots, and `done` (module docstring)."""

    def __init__(self, layers: list[LinearMixerWeights], slots: int, width: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rings = [torch.zeros(slots, width + lay.kernel - 1, lay.conv_dim + 2 * lay.nv, dtype=dtype,
                                  device=device) for lay in layers]
        self.states = [torch.zeros(slots, lay.nv, lay.dk, lay.dv, dtype=torch.float32, device=device)
                       for lay in layers]
        self.done = torch.zeros(slots, dtype=torch.long, device=device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.rings, *self.states))

    def prefill(self, j: int, lay: LinearMixerWeights, h: Tensor, lengths: Tensor, slot_ids: Tensor) -> Tensor:
        """Layer j's mixer on right-padded prompts h [B, T, H] into slots `slot_ids`: the chunked kernel
        with the padding's g and beta zeroed (so it leaves the state alone), the state after each
        prompt and its last inputs kept for the slot."""
        p0, p1, p2, p3, conv_w, conv_b, a_log, dt_bias, norm_w, out_w = lay.tensors
        b, t = h.shape[:2]
        row, z = project(h, p0, p1, p2, p3, fused=lay.dims["fused"], conv_dim=lay.conv_dim)
        conv = convolve(F.pad(row, (0, 0, lay.kernel - 1, 0)), conv_w, conv_b, t, lay.conv_dim)  # zeros before 0
        q, k, v, g, beta = heads(conv, row, a_log, dt_bias, nk=lay.nk, nv=lay.nv, dk=lay.dk, dv=lay.dv)
        real = (torch.arange(t, device=h.device)[None, :] < lengths.to(h.device)[:, None])[..., None]  # [B, T, 1]
        g, beta = torch.where(real, g, 0.0), torch.where(real, beta, 0.0)
        rep = lay.nv // lay.nk  # heads repeated here: older transformers' kernels expect them so
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        core, state = lay.chunk_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                                     use_qk_l2norm_in_kernel=True)
        slot_ids = slot_ids.to(h.device)
        self.states[j][slot_ids] = state.float()
        ring = self.rings[j]
        keep = min(t, ring.shape[1])
        first = (lengths.to(h.device) - keep).clamp(min=0)
        grid = first[:, None] + torch.arange(keep, device=h.device)[None, :]  # each prompt's last positions (< T)
        ring[slot_ids[:, None], grid.remainder(ring.shape[1])] = row.gather(
            1, grid[..., None].expand(-1, -1, row.shape[-1]))
        return gated_output(core.to(h.dtype), z, norm_w, out_w, lay.dims["norm_eps"])
