"""Token selection: Gumbel-max sampling is a correct sampler and reproducible per request."""

from __future__ import annotations

import pytest
import torch

from dflash_train.generate.builtin import BuiltinEngine
from dflash_train.generate.engine import Request
from dflash_train.generate.sampling import Sampling, gumbel_noise, request_key, select_tokens

from .tiny import make_model


def _select(logits, temp, top_p=1.0, top_k=0, keys=None, steps=None):
    r = logits.shape[0]
    keys = torch.arange(r) if keys is None else keys
    steps = torch.zeros(r, dtype=torch.long) if steps is None else steps
    return select_tokens(
        logits, torch.full((r,), temp), torch.full((r,), top_p), torch.full((r,), top_k, dtype=torch.long),
        keys, steps, any_sampled=temp > 0, any_filtered=top_k > 0 or top_p < 1,
    )  # fmt: skip


def test_noise_is_a_pure_function_of_key_step_and_column():
    keys, steps = torch.tensor([1, 2, 1]), torch.tensor([5, 5, 5])
    g = gumbel_noise(keys, steps, 50)
    assert torch.equal(g[0], g[2]) and not torch.equal(g[0], g[1])
    assert torch.equal(gumbel_noise(keys[:1], steps[:1], 50)[0], g[0])  # batch-independent
    assert not torch.equal(gumbel_noise(keys[:1], steps[:1] + 1, 50)[0], g[0])
    assert torch.isfinite(g).all()


def test_sampling_follows_the_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 20000
    logits = probs.log().expand(n, -1)
    picks = _select(logits, 1.0, keys=torch.arange(n) * 7919 + 3)
    freq = torch.bincount(picks, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=0.015), freq
    # temperature 0.5 sharpens exactly like softmax(logits / 0.5)
    picks = _select(logits, 0.5, keys=torch.arange(n) + 12345)
    freq = torch.bincount(picks, minlength=4).float() / n
    assert torch.allclose(freq, torch.softmax(probs.log() / 0.5, -1), atol=0.015), freq


def test_top_k_and_top_p_restrict_the_candidates():
    n = 4000
    logits = torch.tensor([3.0, 2.9, 2.8, 0.0, -1.0]).expand(n, -1)
    assert set(_select(logits, 1.0, top_k=2, keys=torch.arange(n)).tolist()) == {0, 1}
    # top_p: the smallest prefix reaching 0.5 holds tokens 0 and 1 (p ~ 0.35 + 0.32)
    assert set(_select(logits, 1.0, top_p=0.5, keys=torch.arange(n)).tolist()) == {0, 1}
    assert set(_select(logits, 1.0, top_p=1e-6, keys=torch.arange(n)).tolist()) == {0}
    assert _select(logits[:3], 0.0).tolist() == [0, 0, 0]  # greedy ignores keys


def test_mixed_greedy_and_sampled_rows():
    logits = torch.tensor([[0.0, 1.0, 0.5]] * 2)
    out = select_tokens(
        logits, torch.tensor([0.0, 1.0]), torch.ones(2), torch.zeros(2, dtype=torch.long),
        torch.tensor([1, 2]), torch.zeros(2, dtype=torch.long), any_sampled=True, any_filtered=False,
    )  # fmt: skip
    assert out[0].item() == 1


def test_sampled_conversation_does_not_depend_on_the_batch():
    model = make_model("qwen3", vocab=256, seed=5)
    sampling = Sampling(temperature=1.0, top_p=0.9, top_k=50)

    def run(slots, items):
        engine = BuiltinEngine(model, None, slots=slots, max_prompt_tokens=16, max_new_tokens=16, stop_ids=set())
        queue = iter([Request(prompt_ids=p, sampling=sampling, max_new_tokens=16, key=request_key(0, i), tag=i)
                      for i, p in items])
        out = {}
        engine.run(lambda: next(queue, None), lambda r, c: out.__setitem__(r.tag, c.token_ids))
        return out

    prompts = [[3, 4, 5], [9, 8], [20, 21, 22, 23], [7]]
    alone = {i: run(1, [(i, p)])[i] for i, p in enumerate(prompts)}
    together = run(3, list(enumerate(prompts)))
    assert all(together[i] == alone[i] for i in range(len(prompts)))
    assert len({tuple(v) for v in together.values()}) == len(prompts)


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)])
def test_sampling_validation(bad):
    with pytest.raises(ValueError):
        Sampling(**bad)


def test_greedy_rows_stay_exact_next_to_sampled_rows():
    from .test_builtin_engine import hf_greedy

    model = make_model("llama", vocab=256, seed=8)
    model.generation_config.eos_token_id = None
    prompts = [[3, 4, 5], [9, 8], [20, 21, 22, 23], [7], [11, 12]]
    engine = BuiltinEngine(model, None, slots=3, max_prompt_tokens=8, max_new_tokens=12, stop_ids=set())
    queue = iter([Request(prompt_ids=p, max_new_tokens=12, key=i, tag=i,
                          sampling=Sampling() if i % 2 == 0 else Sampling(1.0, top_k=20)) for i, p in enumerate(prompts)])
    out = {}
    engine.run(lambda: next(queue, None), lambda r, c: out.__setitem__(r.tag, c.token_ids))
    for i in (0, 2, 4):
        assert out[i] == hf_greedy(model, prompts[i], None)[:12]


@pytest.mark.parametrize("filtered", [False, True])
def test_the_engine_samples_only_the_sampling_rows_and_gets_the_whole_batchs_tokens(filtered):
    """`_select` runs the sampling math on the rows that sample alone (the decode step: the slots
    in `_sampling`; a prefill: positions among its rows); every token equals what sampling the
    whole batch gives, greedy rows their argmax."""
    model = make_model("qwen3", vocab=256, seed=5)
    engine = BuiltinEngine(model, None, slots=7, max_prompt_tokens=8, max_new_tokens=8, stop_ids=set())
    g = torch.Generator().manual_seed(1)
    sampling_slots = [1, 4, 5]
    engine.temperature[sampling_slots] = torch.tensor([1.0, 0.7, 1.3])
    engine.top_p[4], engine.top_k[5] = 0.8, 20
    engine.keys.copy_(torch.randint(0, 2**31, (7,), generator=g))
    engine.steps.copy_(torch.randint(0, 50, (7,), generator=g))
    for slot, top_p, top_k in ((1, 1.0, 0), (4, 0.8, 0), (5, 1.0, 20)):
        if filtered or (top_p == 1.0 and top_k == 0):
            engine._track_sampling(slot, Request(prompt_ids=[1], sampling=Sampling(1.0, top_p, top_k)), True)
    logits = torch.randn(7, 256, generator=g) * 0.3  # flat: a sampled token is rarely the argmax
    whole = select_tokens(logits, engine.temperature, engine.top_p, engine.top_k, engine.keys, engine.steps,
                          any_sampled=True, any_filtered=engine._n_filtered > 0)
    if filtered:
        assert engine._n_filtered == 2 and engine._sampling == set(sampling_slots)
        assert torch.equal(engine._select(logits), whole)
        # a prefill of slots [5, 0, 4]: its rows 0 and 2 sample
        slots = torch.tensor([5, 0, 4])
        assert torch.equal(engine._select(logits[slots], slots, torch.tensor([0, 2])), whole[slots])
    assert torch.equal(engine._select(logits)[[0, 2, 3, 6]], logits[[0, 2, 3, 6]].argmax(-1))
    assert not torch.equal(whole[sampling_slots], logits[sampling_slots].argmax(-1))  # the rows did sample
