"""A windowed drafter's bounded context (speculative/static_drafter.py: the ring): its proposals
equal the full-context reference (DFlashProposer, the training masks over every committed
position) while its cache holds W + 2B positions; speculative decoding with it commits exactly
what plain greedy decoding commits, batch 1 and batched (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from dflash_train.drafter.config import FULL, SLIDING, drafter_config_from_target
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.speculative.engine import SpecEngine
from dflash_train.speculative.decoders import make_proposer
from dflash_train.speculative.loop import SpeculativeDecoder
from dflash_train.generate.attention import ring_length, ring_rule
from dflash_train.speculative.static_drafter import StaticDrafter

from ..eval.conftest import ScriptedProposer, plain_greedy, random_drafter
from .test_engine import OracleDrafts, RecordingSlow, RecordingStatic

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

W, B = 6, 4


def windowed_drafter(model, tok, *, layer_types: list[str], causal: bool = True, seed: int = 0) -> DFlashDrafter:
    cfg = drafter_config_from_target(
        model.config, mask_token_id=tok.convert_tokens_to_ids("<mask>"), num_hidden_layers=len(layer_types),
        block_size=B, num_taps=3, layer_types=layer_types, sliding_window=W, causal_in_block_sliding=causal,
        causal_in_block_full=causal)
    torch.manual_seed(seed)
    drafter = DFlashDrafter(cfg)
    drafter.reset_parameters(std=0.2)
    return drafter.eval()


def test_ring_rule_reads_each_slot_as_its_latest_position():
    """Ring slot j of a 10-slot ring, block of 4 at p: the position it is read as, and the
    rule applied there (a never-written, negative position hidden)."""
    seen = []
    rule = ring_rule(lambda p, q, key: seen.append(key) or key >= 0, 10, 4)
    p, slots = torch.tensor(17), torch.arange(10)
    assert rule(p, torch.tensor(0), slots).all()
    assert seen[0].tolist() == [20, 11, 12, 13, 14, 15, 16, 17, 18, 19]  # 17 + 3 = 20 is the newest
    assert ring_rule(lambda p, q, key: key >= -100, 10, 4)(torch.tensor(2), 0, slots).tolist() == [True] * 6 + [False] * 4
    assert ring_length([6, 6], 4, 1000, "dense") == 14 and ring_length([6, 6], 4, 1000, "flex") == 128
    assert ring_length([6, None], 4, 1000, "dense") is None and ring_length([6], 4, 14, "dense") is None


@pytest.mark.parametrize("case", ["sliding", "sliding-noncausal", "option", "option-flex"])
def test_ring_proposals_equal_full_context(case, loaded_targets):
    """3 slots whose prompts (4, 20 and 33 tokens, right padded) outgrow a window of 6, then
    engine-like rounds (uncommitted tails of garbage) that wrap the ring many times: hidden
    states and drafts equal the full-context reference at every slot, and the cache is the ring."""
    model, tok = loaded_targets["qwen3"]
    window = None
    if case.startswith("option"):  # a full + sliding drafter decoded with the window option
        drafter, window = random_drafter(model, tok, B, layers=2, sliding=W, causal_full=True), W
    else:
        drafter = windowed_drafter(model, tok, layer_types=[SLIDING] * 2, causal=case == "sliding")
    kind = "flex" if case == "option-flex" else "dense"
    max_len = 256 if kind == "flex" else 128
    proposer = make_proposer(drafter, model, copy_drafter=True, window=window)
    embed = model.get_input_embeddings().weight
    static = StaticDrafter(drafter, embed, embed, slots=3, max_len=max_len, attention=kind, window=window)
    assert static.k_cache.shape[3] == static.ring_len == (128 if kind == "flex" else W + 2 * B)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, drafter.config.vocab_size, (3, 200), generator=g)
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
    taps = torch.cat([hs[i + 1] for i in drafter.config.target_layer_ids], -1)
    lengths = [4, 20, 33]
    anchors = [60, 47, 170] if kind == "flex" else [45, 29, 70]  # flex: past its 128-slot ring
    with torch.no_grad():
        padded = torch.stack([torch.cat([taps[s, :n], torch.randn(33 - n, taps.shape[-1], generator=g)])
                              for s, n in enumerate(lengths)])
        static.start(ids[:, :33], torch.tensor(lengths), torch.arange(3), padded)
        committed = list(lengths)
        while committed != anchors:
            step = [min(int(torch.randint(1, B + 1, (1,), generator=g)), a - c) for a, c in zip(anchors, committed)]
            block = torch.randn(3, B, taps.shape[-1], generator=g) * 5
            for s in range(3):
                block[s, :step[s]] = taps[s, committed[s]:committed[s] + step[s]]
            static.extend(block, torch.tensor(committed))
            committed = [c + k for c, k in zip(committed, step)]
        tokens, positions = ids[torch.arange(3), anchors], torch.tensor(anchors)
        hidden = static.block_hidden(tokens, positions, max_len)
        drafts = static.propose(tokens, positions, max_len)
    for s, p in enumerate(anchors):
        proposer.start()
        proposer.extend(taps[s, :p], torch.arange(p))
        torch.testing.assert_close(hidden[s], proposer.block_hidden(int(tokens[s]), p), atol=1e-5, rtol=1e-5)
        assert drafts[s].tolist() == proposer.propose(ids[s, :p + 1].tolist(), p)


def test_full_attention_layer_keeps_every_position(loaded_targets):
    """Without the option, a drafter with a full-attention layer needs the whole context."""
    model, tok = loaded_targets["llama"]
    embed = model.get_input_embeddings().weight
    mixed = windowed_drafter(model, tok, layer_types=[SLIDING, FULL])
    static = StaticDrafter(mixed, embed, embed, slots=2, max_len=128)
    assert static.ring_len is None and static.k_cache.shape[3] == 128
    with pytest.raises(ValueError, match="window must be >= 1"):
        StaticDrafter(mixed, embed, embed, slots=2, max_len=128, window=0)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_windowed_speculative_equals_greedy_and_full_context(kind, loaded_targets):
    """Prompts longer than the window. Batch 1: scripted drafts commit 1..B tokens a round while
    the ring drafter runs alongside: its proposals, round after round, equal the full-context
    proposer's on the slow decoder; with its own drafts, speculative = plain greedy output.
    One ring serves the prompts in turn. Batched (3 slots, refilled): what batch 1 commits, token for token and round for round."""
    model, tok = loaded_targets[kind]
    vocab, new = model.config.vocab_size, 40
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (3, 25, 61, 12, 40)]
    embed = model.get_input_embeddings().weight
    cases = [(windowed_drafter(model, tok, layer_types=[SLIDING] * 2), None),
             (random_drafter(model, tok, B, layers=2, sliding=W), W)]
    for drafter, window in cases:
        layers = drafter.config.target_layer_ids
        ring = StaticDrafter(drafter, embed, embed, slots=1, max_len=128, window=window)
        for prompt in prompts[2::-1]:  # the short prompt last: the ring holds an earlier sequence's keys
            ref = plain_greedy(model, layers, set(), prompt, new).tokens
            fast_source = RecordingStatic(ring, OracleDrafts({tuple(prompt): ref}, B, [3, 0, 1, 2, 3], vocab))
            fast = SpecEngine(model, fast_source, set(), max_len=128).generate(prompt, new)
            slow_source = RecordingSlow(make_proposer(drafter, model, copy_drafter=True, window=window),
                                        ScriptedProposer(ref, len(prompt), B, [3, 0, 1, 2, 3], vocab))
            with SpeculativeDecoder(model, layers, set()) as slow_decoder:
                slow = slow_decoder.generate(prompt, new, slow_source)
            assert fast.tokens == slow.tokens == ref and {r.committed for r in fast.rounds} == {1, 2, 3, 4}
            assert len(slow_source.recorded) > 10
            assert fast_source.recorded[: len(slow_source.recorded)] == slow_source.recorded
        one = SpecEngine(model, drafter, set(), slots=1, max_len=128, draft_window=window)
        assert one.drafter.ring_len == W + 2 * B
        expected = [one.generate(p, new) for p in prompts]
        assert [e.tokens for e in expected] == [one.generate(p, new, speculative=False).tokens for p in prompts]
        many = SpecEngine(model, drafter, set(), slots=3, max_len=128, draft_window=window)
        got = many.generate_batch(prompts, new)
        assert [(r.tokens, r.rounds) for r in got] == [(e.tokens, e.rounds) for e in expected]
