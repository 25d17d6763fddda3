"""The speculative engine's CUDA path, which the CPU tests cannot reach: pinned report buffers
read a round late (overlap_rounds), CUDA events, CUDA-graphed prefill and rounds, compiled
per-layer functions, the drafter's context ring. On one GPU in fp32, every prompt's tokens equal
plain greedy decoding, and the pipelined run equals the one-round-at-a-time run round for round,
at batch 1 and with 3 slots and refills. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_train.speculative.engine import SpecEngine

from ..eval.conftest import plain_greedy, random_drafter
from ..generate.tiny import make_model
from .test_engine import random_prompts

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
B, NEW = 4, 24


def summary(results):
    return [(r.tokens, [(x.drafted, x.accepted, x.committed) for x in r.rounds], r.finish_reason) for r in results]


@needs_gpu
@pytest.mark.parametrize("compile", [False, True])
@pytest.mark.parametrize("draft_window", [None, 8])
def test_gpu_engine_equals_plain_greedy_pipelined_or_not(targets, compile, draft_window):
    _, tok = targets["llama"]
    # heads of 16 dims, FlexAttention's minimum (the shared tiny targets have 8): compiled, the
    # batch-1 engine then decodes with compiled flex attention, the path this test is for
    cpu_model = make_model("llama", vocab=len(tok), seed=1)
    model = copy.deepcopy(cpu_model).cuda()
    drafter = random_drafter(cpu_model, tok, B, sliding=3).cuda()
    prompts = random_prompts(model.config.vocab_size, (12, 1, 30, 5, 21, 2, 9, 17), seed=4)
    free_run = [plain_greedy(model, [0], set(), p, NEW).tokens for p in prompts]
    stop = {free_run[3][0]}  # one row ends at its prefill
    expected = [f[:next((i + 1 for i, t in enumerate(f) if t in stop), NEW)] for f in free_run]
    runs = {}
    for slots in (1, 3):
        for overlap in (True, False):
            engine = SpecEngine(model, drafter, stop, slots=slots, max_len=128, compile=compile,
                                overlap_rounds=overlap, draft_window=draft_window)
            assert engine.attention == ("flex" if compile and slots == 1 else "dense")
            for _ in range(2):  # the second run replays the captured graphs
                results = engine.generate_batch(prompts, NEW)
                assert [r.tokens for r in results] == expected, (slots, overlap)
                assert not engine.active.any()
            runs[slots, overlap] = summary(results)
    assert runs[1, True] == runs[1, False] == runs[3, True] == runs[3, False]


@needs_gpu
@pytest.mark.parametrize("compile", [False, True])
def test_gpu_dspark_engine_equals_plain_greedy(targets, compile):
    """The dspark head inside the captured rounds, compiled by Inductor (its sequential slots
    fused) or not: every token equals plain greedy, and the bigram drafts are accepted."""
    from .test_dspark_engine import bigram_drafter

    _, tok = targets["llama"]
    cpu_model = make_model("llama", vocab=len(tok), seed=1)
    model = copy.deepcopy(cpu_model).cuda()
    prompts = random_prompts(model.config.vocab_size, (12, 1, 30, 5), seed=6)
    expected = [plain_greedy(model, [0], set(), p, NEW).tokens for p in prompts]
    drafter = bigram_drafter(cpu_model, tok, B, [p[-1:] + r for p, r in zip(prompts, expected)]).cuda()
    for slots in (1, 3):
        engine = SpecEngine(model, drafter, set(), slots=slots, max_len=128, compile=compile)
        for _ in range(2):  # the second run replays the captured graphs
            results = engine.generate_batch(prompts, NEW)
            assert [r.tokens for r in results] == expected, slots
        assert sum(x.accepted for r in results for x in r.rounds) > len(prompts)
