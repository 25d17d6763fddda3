"""The Hugging Face speculative path on every family: sliding windows filled, recurrent layers,
MoE, MLA, a multimodal wrapper; the cache rolled back over many rounds of partial acceptance.

Two independent checks per family:
* the output equals transformers' own greedy `generate` and our plain greedy run, with a
  scripted proposer that forces partial acceptance (accept 3, none, all, 1, ... drafts);
* every tap handed to the proposer (computed from the rolled-back cache) equals the hidden
  state of one uncached forward over the whole final sequence: a cache that kept a rejected
  draft, or lost a token out of a window, changes them even where greedy choices survive.
"""

from __future__ import annotations

import pytest
import torch

from dflash_train.speculative.hf_cache import CacheRollback, decoding_cache
from dflash_train.speculative.loop import SpeculativeDecoder
from dflash_train.target.runner import find_decoder_layers
from tests.eval.conftest import ScriptedProposer
from tests.families import FAMILIES, WINDOW, build_model

VOCAB = 300
BLOCK = 8
PROMPT = [(7 * i + 3) % 250 + 5 for i in range(20)]  # longer than WINDOW: the prefill alone overflows it
NEW = 40
PATTERN = [3, 0, BLOCK - 1, 1, 5, 0, 2]  # drafts accepted per round, cycling


@pytest.fixture(scope="module")
def models():
    out = {name: build_model(name, VOCAB) for name in FAMILIES}
    for model in out.values():  # no stop token: every run decodes NEW tokens
        model.generation_config.eos_token_id = None
    return out


def _hf_greedy(model, prompt, new):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _full_forward_taps(model, sequence, layer_ids):
    """Tapped layer outputs of one uncached forward over `sequence` (hooks, as the decoder taps)."""
    seen = {}
    hooks = [find_decoder_layers(model)[i].register_forward_hook(
        lambda m, a, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)) for i in layer_ids]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([sequence]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([seen[i][0] for i in layer_ids], dim=-1)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_partial_acceptance_is_lossless_and_rolls_the_cache_back_exactly(models, name):
    model, layers = models[name], [0, 2]
    reference = _hf_greedy(model, PROMPT, NEW)
    with SpeculativeDecoder(model, layers, set()) as decoder:
        greedy = decoder.generate(PROMPT, NEW)
        proposer = ScriptedProposer(greedy.tokens, len(PROMPT), BLOCK, PATTERN, VOCAB)
        spec = decoder.generate(PROMPT, NEW, proposer)
    assert greedy.tokens == reference
    assert spec.tokens == reference
    accepted = [r.accepted for r in spec.rounds]
    assert 0 in accepted and any(0 < a < BLOCK - 1 for a in accepted) and BLOCK - 1 in accepted
    assert len(spec.rounds) >= 8  # many rollbacks, past the window
    taps = torch.cat([t for t, _ in proposer.extended])
    positions = torch.cat([p for _, p in proposer.extended])
    assert positions.tolist() == list(range(len(taps)))
    full = _full_forward_taps(model, PROMPT + spec.tokens, layers)
    family = FAMILIES[name]
    # recurrent layers: the full forward runs the chunked scan, decoding the step-by-step one, so
    # float32 sums come in another order (1.8e-4 apart seen on a 16-core host); a state rolled
    # back wrongly is off by orders of magnitude more
    tol = 1e-3 if family.recurrent else 1e-4
    torch.testing.assert_close(taps, full[: len(taps)], rtol=tol, atol=tol)
    replays = spec.replay.replays if spec.replay else 0
    # only recurrent layers pay a replay forward; windows decode with a plain full-length cache
    assert (replays > 0) == family.recurrent
    if family.recurrent:
        assert replays == sum(r.accepted < r.drafted for r in spec.rounds[:-1])


def test_windowed_families_decode_with_a_cache_that_crops_exactly(models):
    for name, family in FAMILIES.items():
        cache = decoding_cache(models[name])
        assert (cache is None) == family.recurrent, name
        if cache is not None:  # after a prefill past the window, every layer is a plain full-length one
            with torch.no_grad():
                models[name](input_ids=torch.tensor([PROMPT]), use_cache=True, past_key_values=cache)
            assert not CacheRollback.needs_snapshot(cache), name
            assert cache.get_seq_length() == len(PROMPT) > WINDOW


class _Countdown:
    """A stand-in cache with no `layers`: rolled back by restoring a whole copy."""

    def __init__(self):
        self.seen: list[int] = []

    def get_seq_length(self):
        return len(self.seen)


def test_a_cache_without_layers_is_restored_whole_and_replayed():
    cache, rollback = _Countdown(), CacheRollback()
    cache.seen = [1, 2, 3]
    rollback.snapshot(cache)
    cache.seen += [4, 5, 6, 7]  # the verify forward: token 4 and drafts 5, 6, 7

    def replay(ids, restored):
        assert restored is not cache and restored.seen == [1, 2, 3]
        restored.seen += ids
        return restored

    out = rollback.rollback(cache, 4, [4, 5], replay)  # one draft accepted
    assert out.seen == [1, 2, 3, 4, 5]
    assert (rollback.stats.rounds, rollback.stats.replays, rollback.stats.replayed_tokens) == (1, 1, 2)
    rollback.snapshot(out)
    out.seen += [6, 7]
    assert rollback.rollback(out, 2, [6, 7], replay) is out  # all accepted: nothing to undo
    assert out.seen == [1, 2, 3, 4, 5, 6, 7]
