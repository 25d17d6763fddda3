"""Speculative decoding with a dspark drafter (drafter/markov.py) is lossless: the static engine
(batch 1 and batched) and the slow Hugging Face path commit exactly plain greedy's tokens, in
the same rounds (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.drafter.config import drafter_config_from_target
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.speculative.engine import SpecEngine
from dflash_train.speculative.decoders import make_proposer
from dflash_train.speculative.loop import SpeculativeDecoder
from dflash_train.target.chat_template import stop_token_ids as stop_tokens

from ..eval.conftest import plain_greedy
from .test_engine import random_prompts

NEW = 32


def bigram_drafter(model, tok, block_size: int, outputs: list[list[int]], seed: int = 0) -> DFlashDrafter:
    """A random backbone whose bigram head knows the successor of each token in `outputs` (rank = vocab,
    markov_w1 the identity): drafts then follow the target for a few slots and rounds accept several."""
    vocab = model.config.vocab_size
    cfg = drafter_config_from_target(model.config, mask_token_id=tok.convert_tokens_to_ids("<mask>"),
                                     num_hidden_layers=2, block_size=block_size, num_taps=3,
                                     layer_types=["sliding_attention", "full_attention"], sliding_window=3,
                                     variant="dspark", markov_rank=vocab)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(std=0.2)
    with torch.no_grad():
        drafter.markov_head.markov_w1.weight.copy_(torch.eye(vocab))
        w2 = torch.zeros(vocab, vocab)
        for out in outputs:
            for prev, nxt in zip(out[:-1], out[1:]):
                w2[:, prev] = 0
                w2[nxt, prev] = 100.0
        drafter.markov_head.markov_w2.weight.copy_(w2)
    return drafter.eval()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_dspark_drafts_are_lossless_and_match_the_slow_decoder(kind, targets):  # noqa: F811
    model, tok = targets[kind]
    stop = stop_tokens(tok, model)
    prompts = random_prompts(model.config.vocab_size, (1, 7, 30), seed=2)
    layers = [0, 2, 3]
    references = [plain_greedy(model, layers, stop, p, NEW).tokens for p in prompts]
    for B in (2, 5):
        drafter = bigram_drafter(model, tok, B, [p[-1:] + r for p, r in zip(prompts, references)])
        engine = SpecEngine(model, drafter, stop, slots=1, max_len=128)
        proposer = make_proposer(drafter, model, copy_drafter=True)
        accepted = 0
        with SpeculativeDecoder(model, drafter.config.target_layer_ids, stop) as slow:
            for prompt, ref in zip(prompts, references):
                spec = engine.generate(prompt, NEW)
                assert spec.tokens == ref
                assert spec.rounds == slow.generate(prompt, NEW, proposer).rounds
                accepted += sum(r.accepted for r in spec.rounds)
        assert accepted > len(prompts)  # the drafts were accepted, not just the bonus tokens


def test_dspark_batched_commits_what_batch_one_commits(targets):  # noqa: F811
    model, tok = targets["llama"]
    prompts = random_prompts(model.config.vocab_size, (12, 1, 30, 5, 21), seed=4)
    references = [plain_greedy(model, [0], set(), p, NEW).tokens for p in prompts]
    drafter = bigram_drafter(model, tok, 4, [p[-1:] + r for p, r in zip(prompts, references)], seed=1)
    one = SpecEngine(model, drafter, set(), slots=1, max_len=128)
    expected = [one.generate(p, NEW) for p in prompts]
    many = SpecEngine(model, drafter, set(), slots=3, max_len=128)
    got = many.generate_batch(prompts, NEW)
    for e, r, ref in zip(expected, got, references):
        assert r.tokens == e.tokens == ref
        assert r.rounds == e.rounds
    assert sum(r.accepted for e in expected for r in e.rounds) > len(prompts)


def test_compiled_dspark_head_traces_once_and_matches(targets):  # noqa: F811
    """The GPU path compiles the dspark head (its 15 sequential slots fused with the backbone's
    logits) as it does DFlash's; on CPU, with a non-fusing backend: the same rounds, one graph."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from dflash_train.drafter.dspark import draft_head

    model, tok = targets["llama"]
    prompts = random_prompts(model.config.vocab_size, (9, 30), seed=5)
    references = [plain_greedy(model, [0], set(), p, NEW).tokens for p in prompts]
    drafter = bigram_drafter(model, tok, 4, [p[-1:] + r for p, r in zip(prompts, references)], seed=2)
    expected = SpecEngine(model, drafter, set(), slots=2, max_len=128).generate_batch(prompts, NEW)
    torch._dynamo.reset()
    counters.clear()
    engine = SpecEngine(model, drafter, set(), slots=2, max_len=128)
    engine._compile_layer_functions(backend="aot_eager")
    assert engine.drafter.dspark_head is not draft_head
    got = engine.generate_batch(prompts, NEW)
    assert [(r.tokens, r.rounds) for r in got] == [(r.tokens, r.rounds) for r in expected]
    assert [r.tokens for r in got] == references
    # target pre/post attention, final logits, the commit at widths B and 1 (8); drafter block
    # q/k/v, context k/v, post attention and the dspark head (4): DFlash's head is never called
    assert counters["stats"]["unique_graphs"] == 12
