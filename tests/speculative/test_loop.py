"""Speculative decoding equals plain greedy decoding; the drafter at inference equals the
drafter in training; acceptance is accounted exactly."""

from __future__ import annotations

import pytest
import torch

from dflash_train.drafter.masks import build_layer_masks
from dflash_train.drafter.model import block_input_ids, block_positions
from dflash_train.speculative.decoders import make_proposer
from dflash_train.speculative.loop import Round, SpeculativeDecoder
from dflash_train.speculative.metrics import acceptance_stats
from dflash_train.target.chat_template import stop_token_ids

from ..eval.conftest import ScriptedProposer, plain_greedy, random_drafter


def _prompts(tokenizer, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "count from three"}], tokenize=False,
                                         add_generation_prompt=True)
    return [
        torch.randint(4, vocab, (1,), generator=g).tolist(),
        torch.randint(4, vocab, (7,), generator=g).tolist(),
        torch.randint(4, vocab, (40,), generator=g).tolist(),
        tokenizer(chat, add_special_tokens=False)["input_ids"],
    ]


def _hf_greedy(model, prompt, max_new, stop):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new, do_sample=False, eos_token_id=sorted(stop), pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size,sliding,causal_full", [(2, None, False), (4, 3, False), (8, None, True),
                                                            (16, 5, False)])
def test_random_drafter_output_equals_greedy(kind, block_size, sliding, causal_full, loaded_targets):
    model, tok = loaded_targets[kind]
    vocab = model.get_input_embeddings().weight.shape[0]
    drafter = random_drafter(model, tok, block_size, sliding=sliding, causal_full=causal_full)
    proposer = make_proposer(drafter, model)
    stop = stop_token_ids(tok, model)
    assert tok.convert_tokens_to_ids("<|im_end|>") in stop
    with SpeculativeDecoder(model, drafter.config.target_layer_ids, stop) as dec:
        for prompt in _prompts(tok, vocab):
            greedy = dec.generate(prompt, 48)
            spec = dec.generate(prompt, 48, proposer)
            assert spec.tokens == greedy.tokens
            assert greedy.tokens == _hf_greedy(model, prompt, 48, stop)
            assert all(r.committed == 1 and r.drafted == 0 for r in greedy.rounds) and greedy.tau == 1.0
            assert sum(r.committed for r in spec.rounds) == len(spec.tokens) - 1  # the prefill commits one
            done = 1
            for r in spec.rounds:  # full blocks, except where fewer tokens remain to the limit
                assert r.drafted == min(block_size - 1, 48 - done - 1)
                done += r.committed


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", [3, 8])
def test_oracle_wrong_and_partial_drafters(kind, block_size, loaded_targets):
    """Forced-correct drafts are all accepted (tau = B), forced-wrong ones never (tau = 1),
    and the output equals plain greedy decoding either way."""
    model, tok = loaded_targets[kind]
    vocab = model.get_input_embeddings().weight.shape[0]
    layer_ids = [1, 3]
    stop: set[int] = set()
    for prompt in _prompts(tok, vocab)[1:3]:
        n = 6 * block_size + 1  # whole rounds: prefill 1 + 6 rounds of B
        ref = plain_greedy(model, layer_ids, stop, prompt, n).tokens
        with SpeculativeDecoder(model, layer_ids, stop) as dec:
            oracle = dec.generate(prompt, n, ScriptedProposer(ref, len(prompt), block_size, [block_size - 1], vocab))
            wrong = dec.generate(prompt, n, ScriptedProposer(ref, len(prompt), block_size, [0], vocab))
            pattern = [block_size - 1, 0, 1, block_size - 2]
            partial = dec.generate(prompt, n, ScriptedProposer(ref, len(prompt), block_size, pattern, vocab))
        assert oracle.tokens == wrong.tokens == partial.tokens == ref
        assert oracle.tau == block_size and len(oracle.rounds) == 6
        assert all(r.accepted == r.drafted == block_size - 1 for r in oracle.rounds)
        assert wrong.tau == 1.0 and all(r.accepted == 0 for r in wrong.rounds)
        assert [r.accepted for r in partial.rounds[:4]] == pattern


def test_stop_token_inside_accepted_drafts(loaded_targets):
    """A stop token among accepted drafts ends the output there, the stop token included."""
    model, tok = loaded_targets["llama"]
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = _prompts(tok, vocab)[2]
    ref = plain_greedy(model, [1, 3], set(), prompt, 40).tokens
    # first occurrence at index i, in the middle of a round of B = 8 (rounds cover 1..8, 9..16, ...)
    stop_at = next(i for i in range(5, 40) if ref[i] not in ref[:i] and 2 <= i % 8 <= 6)
    stop = {ref[stop_at]}
    greedy = plain_greedy(model, [1, 3], stop, prompt, 40)
    assert greedy.tokens == ref[:stop_at + 1] and greedy.finish_reason == "stop"
    with SpeculativeDecoder(model, [1, 3], stop) as dec:
        spec = dec.generate(prompt, 40, ScriptedProposer(ref, len(prompt), 8, [7], vocab))
    assert spec.tokens == greedy.tokens and spec.finish_reason == "stop"
    assert spec.rounds[-1].accepted > spec.rounds[-1].committed - 1  # drafts past the stop were accepted, not committed
    assert greedy.tokens == _hf_greedy(model, prompt, 40, stop)


def test_max_new_tokens_limits_drafts(loaded_targets):
    model, tok = loaded_targets["qwen3"]
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = _prompts(tok, vocab)[1]
    ref = plain_greedy(model, [1, 3], set(), prompt, 10).tokens
    with SpeculativeDecoder(model, [1, 3], set()) as dec:
        spec = dec.generate(prompt, 10, ScriptedProposer(ref, len(prompt), 4, [3], vocab))
    # prefill 1, rounds commit 4, 4, then only 1 token is left: no drafts
    assert spec.tokens == ref and [(r.drafted, r.committed) for r in spec.rounds] == [(3, 4), (3, 4), (0, 1)]
    assert spec.finish_reason == "length"


def test_drafter_context_gets_the_taps_of_committed_tokens(loaded_targets):
    """The taps handed to the drafter during decoding equal the target's hidden states
    (hidden_states[l + 1]) of one full forward over the final sequence, position by position."""
    model, tok = loaded_targets["llama"]
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = _prompts(tok, vocab)[1]
    layer_ids = [0, 2, 4]  # not the last layer: HF applies the final norm to hidden_states[-1]
    ref = plain_greedy(model, layer_ids, set(), prompt, 30).tokens
    rec = ScriptedProposer(ref, len(prompt), 4, [3, 0, 2, 1], vocab)
    with SpeculativeDecoder(model, layer_ids, set()) as dec:
        dec.generate(prompt, 30, rec)
    taps = torch.cat([t for t, _ in rec.extended])
    positions = torch.cat([p for _, p in rec.extended])
    assert positions.tolist() == list(range(len(positions)))
    full = model(torch.tensor([prompt + ref]), output_hidden_states=True).hidden_states
    expect = torch.cat([full[i + 1][0] for i in layer_ids], dim=-1)[: len(positions)]
    torch.testing.assert_close(taps, expect, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("sliding,causal_full", [(None, False), (None, True), (4, False)])
def test_inference_drafter_equals_training_forward(sliding, causal_full, loaded_targets):
    """Cached context K/V + the block at inference == the training forward (mask from
    drafter/masks.py) for the same anchor, whatever chunks the context arrived in."""
    model, tok = loaded_targets["qwen3"]
    B = 6
    drafter = random_drafter(model, tok, B, layers=3, sliding=sliding, causal_full=causal_full)
    cfg = drafter.config
    proposer = make_proposer(drafter, model)
    S = 23
    ids = torch.randint(4, model.config.vocab_size, (1, S), generator=torch.Generator().manual_seed(3))
    hs = model(ids, output_hidden_states=True).hidden_states
    taps = torch.cat([hs[i + 1] for i in cfg.target_layer_ids], dim=-1)  # [1, S, n*H]
    pos = torch.arange(S)[None]
    doc = torch.zeros_like(ids)
    for anchor in (1, 9, 20):
        anchors, valid = torch.tensor([[anchor]]), torch.tensor([[True]])
        masks = build_layer_masks(cfg, doc, pos, anchors, valid, backend="dense")
        block = torch.nn.functional.embedding(block_input_ids(ids, anchors, B, cfg.mask_token_id),
                                              model.get_input_embeddings().weight)
        with torch.no_grad():
            train_hidden = drafter(taps, pos, block, block_positions(pos, anchors, B), masks)[0]
        proposer.start()
        cuts = [0, anchor // 3, anchor // 2 + 1, anchor]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            if hi > lo:
                proposer.extend(taps[0, lo:hi], torch.arange(lo, hi))
        infer_hidden = proposer.block_hidden(int(ids[0, anchor]), anchor)
        torch.testing.assert_close(infer_hidden, train_hidden, atol=1e-5, rtol=1e-5)


def test_tau_accounting_by_hand():
    """B = 4, max_new_tokens = 12; correct draft prefixes 3, 0, 1, 2, then 1 token left."""
    rounds = [Round(3, 3, 4), Round(3, 0, 1), Round(3, 1, 2), Round(3, 2, 3), Round(0, 0, 1)]
    s = acceptance_stats(rounds, 4)
    assert s["rounds"] == 5 and s["committed"] == 11 and s["tau"] == pytest.approx(11 / 5)
    assert s["accept_hist"] == [2, 1, 1, 1]
    assert s["accept_rate"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert s["accept_rate_cond"] == pytest.approx([3 / 4, 2 / 3, 1 / 2])


def test_tau_accounting_through_the_decoder(loaded_targets):
    """The same hand-made case produced by a real decoding run."""
    model, tok = loaded_targets["llama"]
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = _prompts(tok, vocab)[1]
    ref = plain_greedy(model, [1, 3], set(), prompt, 12).tokens
    with SpeculativeDecoder(model, [1, 3], set()) as dec:
        spec = dec.generate(prompt, 12, ScriptedProposer(ref, len(prompt), 4, [3, 0, 1, 2], vocab))
    assert spec.rounds == [Round(3, 3, 4), Round(3, 0, 1), Round(3, 1, 2), Round(3, 2, 3), Round(0, 0, 1)]
    assert spec.tau == pytest.approx(2.2) and spec.tokens == ref
