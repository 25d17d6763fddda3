"""Tiny fp32 targets (from the shared fixtures) loaded once, and proposers for tests."""

from __future__ import annotations

from typing import Sequence

import pytest
import torch

from dflash_train.drafter.config import SLIDING, drafter_config_from_target
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.speculative.loop import SpeculativeDecoder
from dflash_train.target.loading import load_causal_lm, load_tokenizer


@pytest.fixture(scope="session")
def loaded_targets(tiny_targets):
    """{"llama": (model, tokenizer), "qwen3": ...}, fp32 on CPU."""
    return {k: (load_causal_lm(d, dtype=torch.float32), load_tokenizer(d)) for k, d in tiny_targets.items()}


def random_drafter(model, tokenizer, block_size: int, *, layers: int = 2, sliding: int | None = None,
                   causal_full: bool = False, seed: int = 0) -> DFlashDrafter:
    layer_types = None
    if sliding:  # one sliding layer (causal in block by default) + full layers
        layer_types = [SLIDING] + ["full_attention"] * (layers - 1)
    cfg = drafter_config_from_target(
        model.config, mask_token_id=tokenizer.convert_tokens_to_ids("<mask>"), num_hidden_layers=layers,
        block_size=block_size, num_taps=3, layer_types=layer_types, sliding_window=sliding,
        causal_in_block_full=causal_full)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(std=0.2)  # larger weights: less uniform drafts than the 0.02 default
    return drafter.eval()


class ScriptedProposer:
    """Proposes the target's true greedy continuation (`reference`, the plain greedy output)
    for the first `correct[r]` slots of round r (cycling), then tokens that are surely wrong.
    correct = [B-1] is an oracle; correct = [0] never matches."""

    def __init__(self, reference: list[int], prompt_len: int, block_size: int, correct: Sequence[int], vocab: int):
        self.reference, self.prompt_len, self.block_size = reference, prompt_len, block_size
        self.correct, self.vocab = list(correct), vocab
        self.extended: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.round = 0

    def start(self) -> None:
        self.extended.clear()
        self.round = 0

    def extend(self, taps: torch.Tensor, positions: torch.Tensor) -> None:
        self.extended.append((taps.clone(), positions.clone()))

    def propose(self, sequence, position: int) -> list[int]:
        assert position == len(sequence) - 1
        done = len(sequence) - self.prompt_len  # output tokens so far
        m = self.correct[self.round % len(self.correct)]
        self.round += 1
        truth = self.reference[done:done + self.block_size - 1]
        truth += [0] * (self.block_size - 1 - len(truth))  # past the reference's end: anything
        return [t if k < m else (t + 1) % self.vocab for k, t in enumerate(truth)]


def plain_greedy(model, layer_ids, stop, prompt, max_new):
    with SpeculativeDecoder(model, layer_ids, stop) as dec:
        return dec.generate(prompt, max_new)
