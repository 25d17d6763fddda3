"""The held-out estimate predicts measured tau: on the target's own greedy answers (fp32), the
teacher-forced walk gives exactly the rounds real speculative decoding makes."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from dflash_train.data.batching import BatchPlanConfig, BatchPlanner
from dflash_train.data.prompts import Prompt, encode_prompt
from dflash_train.data.splits import DataSplits
from dflash_train.drafter.loss import LossConfig
from dflash_train.drafter.step import FrozenHeads, StepConfig, drafter_step
from dflash_train.speculative.evaluate import HeldOutProbe
from dflash_train.speculative.metrics import repetition_rate, round_offsets, tau_by_position, walk_rounds
from dflash_train.target.chat_template import stop_token_ids
from dflash_train.target.runner import TargetRunner
from dflash_train.train.evaluate import answer_spans, estimate_on_split, walk_batch
from dflash_train.train.step import batch_seed

from ..eval.conftest import loaded_targets, random_drafter  # noqa: F401 - fixture


class Rows:
    """An in-memory dataset: (ids, loss mask) per row, with lengths."""

    def __init__(self, rows: list[tuple[list[int], list[int]]]):
        self.rows = [(np.asarray(i, dtype=np.int64), np.asarray(m, dtype=bool)) for i, m in rows]
        self.lengths = np.array([len(i) for i, _ in self.rows])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]


def test_walk_rounds_and_buckets_by_hand():
    # anchors 0..5 of a 7-token answer; a round anchored at i accepts accepted[i] drafts
    accepted = [2, 0, 0, 1, 9, 0]
    assert walk_rounds(accepted) == [(0, 3), (3, 2), (5, 1)]
    assert walk_rounds(accepted, limit=3) == [(0, 3)]
    assert tau_by_position([(0, 3), (3, 2), (130, 4)], bucket=128) == {"0-127": 2.5, "128-255": 4.0}
    assert repetition_rate([1, 2, 3, 1, 2, 3, 1], n=3) == pytest.approx(2 / 5)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 0]])
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, -1]])
    assert answer_spans(mask, doc) == [(0, 1, 3), (0, 4, 5)]


def _spans_by_scanning(mask: list[int], doc: list[int]) -> list[tuple[int, int]]:
    """Answer runs of one row, position by position: the brute-force reference."""
    spans, start = [], None
    for p in range(len(mask) + 1):
        on = p < len(mask) and mask[p]
        if start is not None and (not on or doc[p] != doc[start]):
            spans.append((start, p))
            start = None
        if on and start is None:
            start = p
    return spans


def _walk_by_dict(anchors, valid, acc, mask, doc, ids, limit):
    """walk_batch's rule one answer at a time from a dict of the drawn anchors: the reference."""
    rounds, all_anchor, repeats = [], [], []
    for r in range(mask.shape[0]):
        for start, end in _spans_by_scanning(mask[r].tolist(), doc[r].tolist()):
            drawn = {int(a): int(x) for a, x, v in zip(anchors[r], acc[r], valid[r]) if v and start <= a < end - 1}
            if len(drawn) != end - 1 - start:
                continue
            answer = [drawn[p] for p in range(start, end - 1)][: max(limit - 1, 0)]
            rounds.extend(walk_rounds(answer))
            all_anchor.extend(a + 1 for a in answer)
            repeats.append(repetition_rate(ids[r, start:min(end, start + limit)].tolist()))
    return rounds, all_anchor, repeats


@pytest.mark.parametrize("seed", range(6))
def test_walk_batch_equals_the_answer_by_answer_reference(seed):
    g = torch.Generator().manual_seed(seed)
    R, S, N = 3, 97, 70
    mask = (torch.rand(R, S, generator=g) < 0.7).long()
    doc = torch.cumsum((torch.rand(R, S, generator=g) < 0.08).long(), dim=1)
    doc[:, -5:] = -1  # padding
    ids = torch.randint(0, 7, (R, S), generator=g)
    # distinct sorted anchors a row, some slots invalid (S - 1), as select_anchors draws them
    anchors = torch.stack([torch.sort(torch.randperm(S, generator=g)[:N]).values for _ in range(R)])
    valid = torch.rand(R, N, generator=g) < 0.9
    anchors = torch.where(valid, anchors, S - 1)
    if seed % 2:  # every position drawn: every answer walks
        anchors, valid = torch.arange(S).expand(R, S).clone(), torch.ones(R, S, dtype=torch.bool)
    acc = torch.randint(0, 5, anchors.shape, generator=g)
    fwd = types.SimpleNamespace(anchors=anchors, valid=valid)
    batch = types.SimpleNamespace(loss_mask=mask, document_ids=doc, input_ids=ids)
    for limit in (1, 9, S):
        got = walk_batch(fwd, acc, batch, limit)
        want = _walk_by_dict(anchors, valid, acc, mask, doc, ids, limit)
        assert got[0] == want[0] and got[1] == want[1]
        np.testing.assert_array_equal(got[2], want[2])  # nan where an answer has no n-gram
    assert answer_spans(mask, doc) == [(r, a, b) for r in range(R) for a, b in _spans_by_scanning(
        mask[r].tolist(), doc[r].tolist())]
    assert sum(len(_spans_by_scanning(mask[r].tolist(), doc[r].tolist())) for r in range(R)) > 5


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_estimate_equals_measurement_on_the_targets_own_greedy_text(kind, loaded_targets):  # noqa: F811
    torch.manual_seed(0)
    model, tok = loaded_targets[kind]
    drafter = random_drafter(model, tok, 4, layers=1).train()
    heads = FrozenHeads(model.get_input_embeddings().weight, model.get_output_embeddings().weight)
    stop = stop_token_ids(tok, model)
    prompts = [encode_prompt(tok, Prompt(w, messages=[{"role": "user", "content": f"count from {w}"}]))
               for w in ("one", "two", "red", "blue", "six")]
    max_new = 24
    greedy = HeldOutProbe(model, stop, prompts, max_new_tokens=max_new, slots=2)
    greedy.measure(drafter)  # builds the engine
    answers = [r.tokens for r in greedy.engine.generate_batch(prompts, max_new, speculative=False)]
    rows = [(p + a, [0] * len(p) + [1] * len(a)) for p, a in zip(prompts, answers)]
    data = Rows(rows)
    plan = BatchPlanConfig(token_budget=int(data.lengths.max()), shuffle=False)
    splits = DataSplits(train=data, eval=data, planner=BatchPlanner(data.lengths, plan),
                        eval_planner=BatchPlanner(data.lengths, plan))

    # train the drafter a little on this very text, so that it accepts drafts now and then
    runner = TargetRunner(model, drafter.config.target_layer_ids, need_final=True)
    step_cfg = StepConfig(num_anchors=64, label_source="target", attention="dense")
    optim = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for i in range(30):
        for batch in splits.planner.iter_batches(data, epochs=1):
            out = runner.run_batch(batch, torch.device("cpu"))
            stats = drafter_step(drafter, heads, batch, out, step_cfg=step_cfg, loss_cfg=LossConfig(),
                                 generator=torch.Generator().manual_seed(batch_seed(0, i, batch.index)))
            optim.zero_grad()
            (stats.loss_sum / stats.weight_sum).backward()
            optim.step()

    estimate = estimate_on_split(drafter, heads, runner, splits, step_cfg=step_cfg, loss_cfg=LossConfig(),
                                 device=torch.device("cpu"), seed=0, max_batches=0, limit=max_new)
    runner.close()
    probe = HeldOutProbe(model, stop, prompts, max_new_tokens=max_new, slots=2)
    measured = probe.measure(drafter)
    results = probe.engine.generate_batch(prompts, max_new)
    assert [r.tokens for r in results] == answers  # lossless, fp32
    assert estimate["answers"] == len(prompts)
    assert estimate["tau"] == pytest.approx(measured["tau"], abs=1e-12)
    assert estimate["tau_by_position"] == pytest.approx(measured["tau_by_position"], abs=1e-12)
    rounds = [o for r in results for o in round_offsets(r.rounds)]
    assert measured["tau"] == pytest.approx(sum(c for _, c in rounds) / len(rounds))
    assert estimate["tau"] > 1.05  # the drafter does accept drafts: the equality is not 1 == 1
    assert estimate["tau_all_anchors"] >= estimate["tau"] - 1e-9  # the old mean over anchors never underrates
    assert estimate["repetition_rate"] == pytest.approx(np.mean([repetition_rate(a) for a in answers]))
