"""Measuring the drafter during and after training, like with like.

* `estimate_on_split` (cheap, any step): the eval split, teacher-forced with the target's own
  greedy labels, anchors at every answer position. Per answer, the rounds speculative
  decoding would make over that text (`walk_rounds`: anchor 0, then anchor + accepted + 1,
  ...) give the estimate of tau, over the same answer positions the measurement covers
  (the first `max_new_tokens`), also by position bucket, with the texts' repetition rate.
  The mean over all anchors (the old estimate) is reported too: it overrates tau, since
  decoding jumps over the easy stretches and so visits the hard positions more often.
* `HeldOutProbe` (speculative/evaluate.py): tau measured by real speculative decoding of
  held-out prompts, batched on the fast engine, next to the estimate.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from dflash_train.data.batch import PackedBatch
from dflash_train.data.prompts import encode_prompt, load_prompts
from dflash_train.data.splits import DataSplits
from dflash_train.drafter.loss import LossConfig, StepStats, block_acceptance, drafter_loss, summarize
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.drafter.step import BlockForward, FrozenHeads, StepConfig, drafter_forward, head_operands
from dflash_train.speculative.evaluate import HeldOutProbe
from dflash_train.speculative.metrics import repetition_rate, tau_by_position, tau_of, walk_rounds
from dflash_train.target.chat_template import stop_token_ids
from dflash_train.target.runner import TargetRunner
from dflash_train.train.config import TrainConfig
from dflash_train.train.metrics_log import MetricsLogger
from dflash_train.train.setup import FrozenTarget, pad_batch
from dflash_train.train.step import autocast_for, batch_seed

log = logging.getLogger(__name__)


def answer_spans(loss_mask: torch.Tensor, document_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(row, start, end) of every answer of a packed batch: maximal runs of loss-masked
    positions within one document, [start, end). loss_mask/document_ids [R, S] on the CPU."""
    mask, doc = loss_mask.numpy().astype(bool), document_ids.numpy()
    # a run starts where the mask turns on, or stays on across a document boundary
    begins = mask.copy()
    begins[:, 1:] &= ~mask[:, :-1] | (doc[:, 1:] != doc[:, :-1])
    ends = mask.copy()
    ends[:, :-1] &= ~mask[:, 1:] | (doc[:, 1:] != doc[:, :-1])
    rows, starts = np.nonzero(begins)
    _, lasts = np.nonzero(ends)  # both row-major: the k-th end closes the k-th start
    return list(zip(rows.tolist(), starts.tolist(), (lasts + 1).tolist()))


def accepted_by_position(fwd: BlockForward, accepted: torch.Tensor, seq_len: int) -> np.ndarray:
    """int64 [R, S]: the drafts accepted by the round anchored at each position, -1 where no
    anchor was drawn (valid anchors of a row are distinct positions)."""
    anchors, valid, acc = fwd.anchors.cpu().numpy(), fwd.valid.cpu().numpy(), accepted.cpu().numpy()
    out = np.full((anchors.shape[0], seq_len), -1, dtype=np.int64)
    rows, slots = np.nonzero(valid)
    out[rows, anchors[rows, slots]] = acc[rows, slots]
    return out


def walk_batch(fwd: BlockForward, accepted: torch.Tensor, batch: PackedBatch, limit: int) -> tuple[list, list, list]:
    """(walk rounds (offset, committed) of every answer, mean-over-anchors committed values,
    repetition rates of the answers' first `limit` tokens) of one teacher-forced batch."""
    # one pass over the anchors, then a slice an answer: an evaluation's 20 batches of 8 rows
    # x 8,192 anchors are seconds of host time while the GPU waits, not minutes
    by_pos = accepted_by_position(fwd, accepted, batch.loss_mask.shape[1])
    rounds, all_anchor, repeats = [], [], []
    for r, start, end in answer_spans(batch.loss_mask, batch.document_ids):
        span = by_pos[r, start:end - 1]
        if (span < 0).any():  # not every anchor drawn: no exact walk for this answer
            continue
        answer = span[: max(limit - 1, 0)].tolist()
        rounds.extend(walk_rounds(answer))
        all_anchor.extend(a + 1 for a in answer)
        repeats.append(repetition_rate(batch.input_ids[r, start:min(end, start + limit)].tolist()))
    return rounds, all_anchor, repeats


@torch.no_grad()
def estimate_on_split(drafter: DFlashDrafter, heads: FrozenHeads, runner: TargetRunner, data: DataSplits, *,
                      step_cfg: StepConfig, loss_cfg: LossConfig, device: torch.device, seed: int,
                      max_batches: int, limit: int, num_drafters: int = 1, pad=lambda batch: batch) -> dict:
    """Teacher-forced metrics of the eval split with `target` labels and no noise, and the
    walk estimate of tau over each answer's first `limit` tokens; {} without an eval split."""
    if data.eval is None:
        return {}
    was_training = drafter.training
    drafter.eval()
    row_tokens = int(data.eval_planner.config.row_tokens)  # a packed row's length: every anchor of it
    eval_cfg = dataclasses.replace(step_cfg, label_source="target", noise_sigma=0.0,
                                   num_anchors=max(step_cfg.num_anchors, row_tokens))
    stats: list[StepStats] = []
    rounds, all_anchor, repeats = [], [], []
    for i, batch in enumerate(data.eval_planner.iter_batches(data.eval, start=(0, 0), epochs=1)):
        if max_batches and i >= max_batches:
            break
        batch = pad(batch)
        out = runner.run_batch(batch, device, need_final=True)
        b = batch.to(device, non_blocking=True)
        gen = torch.Generator(device=device).manual_seed(batch_seed(seed, batch.epoch, batch.index * num_drafters, 1))
        with autocast_for(device):
            fwd = drafter_forward(drafter, heads, input_ids=b.input_ids, position_ids=b.position_ids,
                                  document_ids=b.document_ids, loss_mask=b.loss_mask, taps=out.taps,
                                  final_hidden=out.final_hidden, step_cfg=eval_cfg, generator=gen)
            hidden, tail = head_operands(drafter, fwd, b.input_ids)  # dspark: + the bigram head
            stats.append(drafter_loss(hidden, heads.lm_head_weight, fwd.labels, fwd.label_valid, loss_cfg, tail=tail))
            accepted, _ = block_acceptance(hidden, heads.lm_head_weight, fwd.labels, fwd.label_valid,
                                           loss_cfg.chunk_rows, tail=tail)
        for acc, new in zip((rounds, all_anchor, repeats), walk_batch(fwd, accepted, batch, limit)):
            acc.extend(new)
    drafter.train(was_training)
    if not stats:
        return {}
    m = summarize(stats)
    m["tau_all_anchors"] = m.pop("tau")  # the old estimate: mean of 1 + accepted over every anchor
    m.update(tau=tau_of(rounds), tau_by_position=tau_by_position(rounds), answers=len(repeats),
             repetition_rate=sum(repeats) / len(repeats) if repeats else float("nan"))
    return m


def compare(estimate: dict, measured: dict) -> dict:
    """The estimate next to the measurement: tau, by position, repetition; relative error."""
    out = {"estimate_tau": estimate.get("tau", float("nan")), "measured_tau": measured["tau"],
           "estimate_repetition_rate": estimate.get("repetition_rate", float("nan")),
           "measured_repetition_rate": measured["repetition_rate"],
           "measured_prompts": measured["prompts"], "measured_seconds": measured["seconds"]}
    out["estimate_rel_error"] = abs(out["estimate_tau"] - out["measured_tau"]) / out["measured_tau"]
    for name, source in (("estimate", estimate), ("measured", measured)):
        for bucket, tau in source.get("tau_by_position", {}).items():
            out[f"{name}_tau_{bucket}"] = tau
    return out


def describe(step: int, c: dict) -> str:
    buckets = sorted({k.split("_tau_")[1] for k in c if "_tau_" in k}, key=lambda b: int(b.split("-")[0]))
    by_pos = ", ".join(f"{b}: {c.get(f'estimate_tau_{b}', float('nan')):.2f}/{c.get(f'measured_tau_{b}', float('nan')):.2f}"
                       for b in buckets)
    return (f"held-out @ step {step}: tau estimated {c['estimate_tau']:.3f}, measured {c['measured_tau']:.3f} "
            f"({c['measured_prompts']} prompts, {c['measured_seconds']:.1f}s; error {c['estimate_rel_error']:.1%}) | "
            f"by position (est/meas) {by_pos} | repetition {c['estimate_repetition_rate']:.2f}/"
            f"{c['measured_repetition_rate']:.2f}")


class Evaluator:
    """The trainer's evaluation and its time: every run.eval_every steps and at the end of a run, the
    estimate on the eval split and, with eval.spec_prompts, the held-out measurement next to it,
    logged and recorded. Only a process that holds the whole target evaluates (`enabled`: the main
    drafter; a sharded target runs only with its whole group, and a split layout's drafters have none)."""

    def __init__(self, cfg: TrainConfig, data: DataSplits, target: FrozenTarget, tokenizer, step_cfg: StepConfig,
                 device: torch.device, *, padding: tuple[int, int] | None, num_drafters: int, enabled: bool = True):
        self.cfg, self.data, self.target, self.tokenizer = cfg, data, target, tokenizer
        self.step_cfg, self.device, self.padding, self.num_drafters = step_cfg, device, padding, num_drafters
        self.every = cfg.run.eval_every
        self.enabled = enabled and target.runner is not None and not target.sharded
        self.last: tuple[int, dict] = (-1, {})  # (step, result) of the last evaluation
        self.probe: HeldOutProbe | None = None
        self.probe_tried = False

    def maybe_evaluate(self, drafter: DFlashDrafter, step: int, metrics: MetricsLogger | None,
                       tokens_seen: int | None = None) -> dict | None:
        """At every run.eval_every-th step, the evaluation; None at the other steps."""
        if not self.every or step % self.every:
            return None
        return self.evaluate(drafter, step, metrics, tokens_seen)

    def evaluate(self, drafter: DFlashDrafter, step: int, metrics: MetricsLogger | None = None,
                 tokens_seen: int | None = None) -> dict:
        """The evaluation at `step`, measured once however often asked (the end of a run right after an
        eval_every step); {} where this process does not evaluate. `tokens_seen` (the run's training
        tokens so far, all drafters) goes into the recorded rows: held-out tau against it is the
        run's learning curve."""
        if not self.enabled:
            return {}
        if self.last[0] != step:
            self.last = (step, self.measure(drafter, step, metrics, tokens_seen))
        return self.last[1]

    def measure(self, drafter: DFlashDrafter, step: int, metrics: MetricsLogger | None,
                tokens_seen: int | None = None) -> dict:
        e = self.cfg.eval
        seen = {} if tokens_seen is None else {"tokens_seen": tokens_seen}
        if metrics is not None and self.data.eval is not None:  # a minute or so, the GPU busy: say so first
            batches = f"its first {self.cfg.data.eval_batches}" if self.cfg.data.eval_batches else "every"
            metrics.line(f"evaluating @ step {step}: the estimate on {batches} batch(es) of the eval split"
                         + (f", then {e.spec_prompts} prompts by speculative decoding" if e.spec_prompts else ""))
        m = estimate_on_split(drafter, self.target.heads, self.target.runner, self.data, step_cfg=self.step_cfg,
                              loss_cfg=self.cfg.loss, device=self.device, seed=self.cfg.run.seed,
                              max_batches=self.cfg.data.eval_batches, limit=e.spec_max_new_tokens,
                              num_drafters=self.num_drafters, pad=lambda b: pad_batch(b, self.padding))
        if m and metrics is not None:
            metrics.record(step, {**{k: v for k, v in m.items() if k != "tau_by_position"}, **seen}, kind="eval")
            metrics.line(f"eval @ step {step}: tau {m['tau']:.3f} (walk over answers' first {e.spec_max_new_tokens} "
                         f"tokens; mean over anchors {m['tau_all_anchors']:.3f}) | ce {m['ce']:.3f} | "
                         f"acc_1 {m.get('acc_1', float('nan')):.3f}")
        probe = self._probe()
        if probe is None:
            return {"estimate": m}
        measured = probe.measure(drafter)
        c = compare(m, measured) if m else {"measured_tau": measured["tau"]}
        if metrics is not None:
            metrics.record(step, {**c, **seen}, kind="heldout")
            metrics.line(describe(step, c) if m else f"held-out @ step {step}: tau measured {measured['tau']:.3f}")
        return {"estimate": m, "measured": measured, "comparison": c}

    def _probe(self) -> HeldOutProbe | None:
        """The decoder of eval.spec_prompts, built once (None when off or unavailable)."""
        e = self.cfg.eval
        if self.probe_tried or not e.spec_prompts or self.tokenizer is None:
            return self.probe
        self.probe_tried = True
        n = e.spec_num_prompts or None
        if e.spec_prompts == "heldout":
            ids = [p.tolist() for p in self.data.eval_prompts(n)] if self.data.eval is not None else []
        else:
            ids = [encode_prompt(self.tokenizer, p) for p in load_prompts(e.spec_prompts, n)]
        probe = HeldOutProbe(self.target.model, stop_token_ids(self.tokenizer, self.target.model), ids,
                             max_new_tokens=e.spec_max_new_tokens, slots=e.spec_slots)
        if not ids or not probe.available():
            log.warning("eval.spec_prompts=%s: %s; measure the exported drafter with `dflash-train eval`",
                        e.spec_prompts, "no held-out prompts" if not ids else "the fast engine does not support this target")
            return None
        self.probe = probe
        return probe
