"""Greedy speculative decoding with a DFlash drafter (docs/dflash-spec.md, "Inference").

One prompt at a time (batch 1); correctness first:

    prefill the target on the prompt (KV cache + taps)  -> first token = argmax at the last position
    loop:  drafter proposes B-1 tokens after the last committed token (its context: the
           projected taps of every committed token before it, K/V cached per layer)
           target verifies [last, d_1 .. d_{B-1}] in one cached forward
           accept the longest prefix of drafts equal to the target's greedy choices + 1 bonus
           roll the target cache back to the committed tokens (speculative/hf_cache.py);
           hand their taps to the drafter

Plain greedy decoding is the same loop with no drafts (one token per forward, same cache,
same code), so the two outputs can be compared token for token and timed fairly.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from dflash_train.drafter.masks import dense_attention_mask
from dflash_train.drafter.dspark import markov_drafts
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.speculative.hf_cache import CacheRollback, ReplayStats, decoding_cache
from dflash_train.target.runner import find_decoder_layers


@dataclass
class Round:
    """One target verify forward."""

    drafted: int  # drafts verified (d <= B-1; fewer near max_new_tokens)
    accepted: int  # longest prefix of drafts equal to the target's greedy choice (a <= d)
    committed: int  # tokens appended to the output (a + 1, unless cut by a stop token or the limit)


@dataclass
class DecodeResult:
    tokens: list[int]  # new tokens, the stop token included when one ended the output
    rounds: list[Round]  # verify forwards after the prefill (the prefill commits tokens[0])
    finish_reason: str  # "stop" or "length"
    seconds: float  # prefill + decode, wall clock
    prefill_seconds: float
    draft_seconds: float = 0.0  # time spent in the drafter (proposals and context K/V)
    verify_seconds: float = 0.0  # time spent in target verify forwards
    # Plain greedy runs of the static engine (speculative/engine.py): per token, the
    # target's top-1 logit and its margin over the top-2 (see speculative/decoders.py).
    margins: list[float] | None = None
    top_logits: list[float] | None = None
    # The Hugging Face path on targets with recurrent layers: rounds rolled back by a replay forward
    replay: ReplayStats | None = None

    @property
    def tau(self) -> float:
        """Tokens committed per target verify forward."""
        return sum(r.committed for r in self.rounds) / len(self.rounds) if self.rounds else float("nan")


class Proposer(Protocol):
    """Whatever drafts tokens; the DFlash drafter, or test doubles (oracle, always-wrong)."""

    block_size: int

    def start(self) -> None:
        """Forget the previous sequence."""

    def extend(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        """Taps [T, n*H] of newly committed tokens at `positions` [T] (consecutive, in order)."""

    def propose(self, sequence: Sequence[int], position: int) -> list[int]:
        """B-1 drafts following sequence[-1] (the last committed token, at `position`).
        `sequence` is prompt + output so far."""


def layer_windows(cfg, window: int | None) -> list[int | None]:
    """Each drafter layer's window when decoding: its own sliding window, else `window` (a
    decode-time window for full-attention layers; None keeps them full)."""
    return [cfg.window_of(i) if cfg.window_of(i) is not None else window for i in range(cfg.num_hidden_layers)]


class DFlashProposer:
    """A DFlash drafter as a proposer, caching each layer's context K/V between rounds.

    Context K/V depend only on the projected taps and their positions (never on the
    block), so a round computes them only for the tokens committed since the last one.
    The reference: it keeps every position's K/V. `window`: full-attention layers decode with
    this sliding window (StaticDrafter's option, the same masks).
    """

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 window: int | None = None):
        self.drafter = drafter.eval()
        self.cfg = drafter.config
        self.windows = layer_windows(self.cfg, window)
        self.block_size = self.cfg.block_size
        self.embed_weight = embed_weight
        self.lm_head_weight = lm_head_weight
        self.start()

    def start(self) -> None:
        n = self.cfg.num_hidden_layers
        self.ctx_k: list[torch.Tensor | None] = [None] * n
        self.ctx_v: list[torch.Tensor | None] = [None] * n
        self.length = 0

    @torch.no_grad()
    def extend(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        ctx = self.drafter.project_context(taps[None])  # [1, T, H]
        cos, sin = self.drafter.rotary(positions[None].to(ctx.device), ctx.dtype)
        for i, layer in enumerate(self.drafter.layers):
            k, v = layer.self_attn.context_kv(ctx, cos, sin)
            self.ctx_k[i] = k if self.ctx_k[i] is None else torch.cat([self.ctx_k[i], k], dim=2)
            self.ctx_v[i] = v if self.ctx_v[i] is None else torch.cat([self.ctx_v[i], v], dim=2)
        self.length += taps.shape[0]

    def _masks(self, position: int, device) -> list[torch.Tensor]:
        """Per layer [1, B, S+B] masks from the training rule itself (drafter/masks.py).

        The context is the S = `position` committed tokens at positions 0..S-1 and the
        block's anchor is the token at position S: one document of S+1 tokens, anchor S.
        Column S (the anchor as a context key, never visible: s < a) is then dropped.
        """
        S, B = self.length, self.block_size
        if S != position:
            raise RuntimeError(f"drafter context holds {S} tokens but the block starts at position {position}")
        doc = torch.zeros((1, S + 1), dtype=torch.long, device=device)
        pos = torch.arange(S + 1, device=device)[None]
        anchors = torch.tensor([[S]], device=device)
        valid = torch.ones((1, 1), dtype=torch.bool, device=device)
        by_variant = {}
        variants = [(w, self.cfg.causal_in_block_of(i)) for i, w in enumerate(self.windows)]
        for window, causal in dict.fromkeys(variants):
            m = dense_attention_mask(doc, pos, anchors, valid, B, sliding_window=window, causal_in_block=causal)
            by_variant[(window, causal)] = torch.cat([m[..., :S], m[..., S + 1:]], dim=-1)
        return [by_variant[v] for v in variants]

    @torch.no_grad()
    def block_hidden(self, last_token: int, position: int) -> torch.Tensor:
        """Final normed hidden states [B, H] of the block [last_token, MASK, ...] at `position`."""
        B, device = self.block_size, self.embed_weight.device
        ids = torch.full((1, B), self.cfg.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0] = int(last_token)
        dtype = self.drafter.fc.weight.dtype
        x = torch.nn.functional.embedding(ids, self.embed_weight).to(dtype)
        cos, sin = self.drafter.rotary(torch.arange(position, position + B, device=device)[None], dtype)
        masks = self._masks(position, device)
        for i, layer in enumerate(self.drafter.layers):
            x = layer(x, cos, sin, self.ctx_k[i], self.ctx_v[i], masks[i])
        return self.drafter.norm(x)[0]

    @torch.no_grad()
    def propose(self, sequence: Sequence[int], position: int) -> list[int]:
        hidden = self.block_hidden(sequence[-1], position)[1:]  # slots 1..B-1: the tokens after the anchor
        if self.drafter.markov_head is not None:  # dspark: slots drafted left to right (drafter/dspark.py)
            anchor = torch.tensor([int(sequence[-1])], device=hidden.device)
            return markov_drafts(hidden[None], anchor, self.lm_head_weight,
                                 *self.drafter.markov_head.weights())[0].tolist()
        logits = hidden.to(self.lm_head_weight.dtype) @ self.lm_head_weight.T
        return logits.argmax(-1).tolist()


class SpeculativeDecoder:
    """Greedy (speculative) decoding of one frozen Hugging Face causal LM, batch 1.

    Forward hooks on the tapped decoder layers capture their outputs (pre final norm, the
    training taps: `hidden_states[l + 1]`) during every prefill/verify forward.
    """

    def __init__(self, target: torch.nn.Module, layer_ids: Sequence[int], stop_token_ids: set[int] | Sequence[int]):
        self.target = target.eval()
        self.layer_ids = list(layer_ids)
        self.stop_token_ids = {int(t) for t in stop_token_ids}
        layers = find_decoder_layers(target)
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]
        params = inspect.signature(target.forward).parameters
        # transformers >= 5.2x renamed `past_key_values` to `cache` (the old name warns)
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # the prefill needs the last position's logits only (all of them: [P, vocab], GBs for long prompts)
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self.device = next(target.parameters()).device

    def _hook(self, index: int):
        def hook(module, args, output):
            self._captured[index] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> "SpeculativeDecoder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _forward(self, ids: list[int], cache, **kwargs):
        self._captured.clear()
        inp = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.target(input_ids=inp, use_cache=True, **{self._cache_kw: cache}, **kwargs)
        taps = torch.cat([self._captured[i][0] for i in self.layer_ids], dim=-1)  # [T, n*H]
        self._captured.clear()
        return out.logits[0], getattr(out, self._cache_kw), taps

    def _replay(self, ids: list[int], cache):
        """Run committed tokens through the target again to advance a restored cache (hf_cache.py)."""
        return self._forward(ids, cache, **self._last_only)[1]

    def _accept(self, drafts: list[int], greedy: list[int], out: list[int],
                max_new_tokens: int) -> tuple[int, list[int], str]:
        """Greedy acceptance of a verified round: the longest prefix of `drafts` equal to the
        target's choices `greedy` and the target's next token, appended to `out` and cut after a
        stop token or at the limit. Returns (accepted, committed tokens, finish reason or "")."""
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
            accepted += 1
        commit = drafts[:accepted] + [greedy[accepted]]
        for i, tok in enumerate(commit):
            out.append(tok)
            if tok in self.stop_token_ids or len(out) >= max_new_tokens:
                return accepted, commit[: i + 1], "stop" if tok in self.stop_token_ids else "length"
        return accepted, commit, ""

    @torch.no_grad()
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, proposer: Proposer | None = None) -> DecodeResult:
        """Greedy decoding of `prompt_ids`; speculative when a proposer is given."""
        if not prompt_ids:
            raise ValueError("empty prompt")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t_start = time.perf_counter()
        logits, cache, taps = self._forward(list(prompt_ids), decoding_cache(self.target), **self._last_only)
        rollback = CacheRollback(sync)
        token = int(logits[-1].argmax())
        if proposer is not None:
            proposer.start()
            proposer.extend(taps, torch.arange(len(prompt_ids), device=taps.device))
        prefill = time.perf_counter() - t_start
        out = [token]
        rounds: list[Round] = []
        position = len(prompt_ids)  # of `token`, the last committed one
        draft_s = verify_s = 0.0
        finish = "stop" if token in self.stop_token_ids else ("length" if max_new_tokens == 1 else "")
        while not finish:
            drafts: list[int] = []
            remaining = max_new_tokens - len(out)
            if proposer is not None and remaining > 1:
                t = time.perf_counter()
                drafts = [int(d) for d in proposer.propose(list(prompt_ids) + out, position)][: remaining - 1]
                draft_s += time.perf_counter() - t
            t = time.perf_counter()
            rollback.snapshot(cache)
            logits, cache, taps = self._forward([token] + drafts, cache)
            greedy = logits.argmax(-1).tolist()  # greedy[k]: the target's choice after slot k
            verify_s += time.perf_counter() - t  # .tolist() waited for the device
            accepted, commit, finish = self._accept(drafts, greedy, out, max_new_tokens)
            rounds.append(Round(len(drafts), accepted, len(commit)))
            if finish:
                break
            # keep the cache of the committed tokens; the new last token is not in it yet
            t = time.perf_counter()
            cache = rollback.rollback(cache, len(drafts) + 1, [token] + drafts[:accepted], self._replay)
            verify_s += time.perf_counter() - t
            if proposer is not None:
                t = time.perf_counter()
                new_pos = torch.arange(position, position + accepted + 1, device=taps.device)
                proposer.extend(taps[: accepted + 1], new_pos)
                sync()
                draft_s += time.perf_counter() - t
            position += accepted + 1
            token = commit[-1]
        return DecodeResult(out, rounds, finish, time.perf_counter() - t_start, prefill, draft_s, verify_s,
                            replay=rollback.stats if rollback.stats.replays else None)
