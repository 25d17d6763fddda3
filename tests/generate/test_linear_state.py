"""The gated delta rule in closed form (generate/linear_state.py `block_rule`) against its
definition, token by token: decay the state, learn v at key k at rate beta, read with q."""

from __future__ import annotations

import pytest
import torch

from dflash_train.generate.linear_state import advance_, block_rule

S, H, DK, DV = 3, 2, 8, 6


def _inputs(t: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(S, t, H, DK, generator=g), dim=-1) for _ in range(2))
    v = torch.randn(S, t, H, DV, generator=g)
    decay = -torch.rand(S, t, H, generator=g) * 2  # log decay in (-2, 0]
    beta = torch.rand(S, t, H, generator=g)
    return torch.randn(S, H, DK, DV, generator=g), q, k, v, decay, beta


def _by_definition(state, q, k, v, g, beta):
    state, outs = state.clone(), []
    for t in range(k.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        d = (v[:, t] - torch.einsum("shkv,shk->shv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, ..., None] * d[..., None, :]
        outs.append(torch.einsum("shkv,shk->shv", state, q[:, t]))
    return torch.stack(outs, dim=1), state


@pytest.mark.parametrize("t", [1, 2, 7, 16])
def test_the_block_rule_equals_the_rule_token_by_token(t):
    state, q, k, v, g, beta = _inputs(t, seed=t)
    want_out, want_state = _by_definition(state, q, k, v, g, beta)
    out, *pieces = block_rule(state, q, k, v, g, beta)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    advance_(state, *pieces)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("t, kept", [(6, [6, 2, 0]), (1, [1, 1, 0])])  # (1: a decoding step's replay)
def test_masked_tokens_change_nothing_and_the_rest_run_as_if_alone(t, kept):
    """g = beta = 0 on a slot's last tokens (a replay past what it accepted): its state is exactly
    what its first tokens alone give; fully masked, bit for bit the state it had."""
    state, q, k, v, g, beta = _inputs(t, seed=9)
    kept = torch.tensor(kept)
    mask = (torch.arange(t)[None, :] < kept[:, None])[..., None]
    masked = state.clone()
    advance_(masked, *block_rule(masked, q, k, v, torch.where(mask, g, 0.0), torch.where(mask, beta, 0.0))[1:])
    for s, n in enumerate(kept.tolist()[:2]):
        _, want = _by_definition(state[s:s + 1], q[s:s + 1, :n], k[s:s + 1, :n], v[s:s + 1, :n], g[s:s + 1, :n],
                                 beta[s:s + 1, :n])
        torch.testing.assert_close(masked[s:s + 1], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(masked[2], state[2])


@pytest.mark.parametrize("t, tq, n", [(2, 1, 1), (7, 3, 4), (16, 16, 16)])
def test_one_block_gives_its_last_tokens_outputs_and_the_state_after_its_first(t, tq, n):
    """A call's replay and its own tokens as one block: the outputs of the last Tq tokens, and the
    state moved past the first n (the replay) alone."""
    state, q, k, v, g, beta = _inputs(t, seed=11 + t)
    want_out, _ = _by_definition(state, q, k, v, g, beta)
    _, want_state = _by_definition(state, q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n])
    out, *pieces = block_rule(state, q[:, t - tq:], k, v, g, beta, advance=n)
    torch.testing.assert_close(out, want_out[:, t - tq:], atol=1e-5, rtol=1e-5)
    advance_(state, *pieces)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)
