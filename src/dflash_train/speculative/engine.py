"""Greedy speculative decoding (and its plain greedy baseline) on the static-KV engine.

One engine serves generation and evaluation, batch 1 (latency) or many sequences at once.
Every slot holds one sequence; all per-slot state lives in static device buffers
(last committed token, its position, tokens generated, limit, active flag). A round:

    draft step   (one CUDA graph per kv bucket)
        drafter.extend(taps of the block verified last round)   context K/V at their positions
        drafts = drafter.propose(last token, position)          [slots, B-1]
    verify step  (one CUDA graph per kv bucket)
        logits, taps = target.verify([last, drafts], position)  [slots, B, V], [slots, B, n*H]
        greedy acceptance on device (rounds.py): a = longest prefix of drafts equal to the
        target's argmax (capped so the output never passes max_new_tokens), commit a + 1
        tokens, cut after a stop token; update position / last token / count / active flag
    one small copy to the host: the committed tokens and counts (the round's report)

Rounds are scheduled by the continuous-batching core the generate engine runs on
(generate/continuous_batching.py): slots refilled with the next prompts as sequences finish
(on device a finished slot just stops committing), prompts prefilled in padded chunks, and
rounds pipelined (`overlap_rounds`, on by default): every input of a round is already on the
device, so round r+1 is launched before the host reads round r's report. Its kv bucket allows
for round r committing a whole block; a row that finished in round r took part in round r+1,
whose report for it is discarded. A prompt costs no host synchronisation either: its ids,
length and limit go to the device in one copy, its active flag is computed there, and its
first token comes back with the report of its first round.

Plain greedy decoding is the same verify step with T = 1 and no drafter; it also returns
each token's top-1 logit and top-1 minus top-2 margin, for the lossless check in
speculative/decoders.py.

Every slot's rounds depend only on its own sequence, so a prompt commits exactly what it
commits at batch 1 (up to kernel rounding in bf16), whatever runs beside it.

On CPU the same steps run eagerly (what the exactness tests check). On CUDA with `compile`
the per-layer functions, the logits heads and the acceptance are fused by torch.compile, and
at batch 1 attention is the compiled FlexAttention kernel over the whole cache
(generate/attention.py): it reads only the blocks a slot has reached, so one graph per step
serves every length.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import deque
from typing import Callable, Literal, Sequence

import torch
from torch import Tensor

from dflash_train.drafter.model import DFlashDrafter
from dflash_train.generate.attention import FLEX_BLOCK, AttentionKind, decode_attention_for, use_dense_attention
from dflash_train.generate.continuous_batching import (
    DeviceMarks,
    PrefillStage,
    Readback,
    RefillRule,
    pull,
    run_one_step_ahead,
    step_buckets,
)
from dflash_train.generate.decoder import StaticDecoder, head_dim_of
from dflash_train.generate.hybrid_decoder import static_decoder
from dflash_train.generate.graphs import GraphedStep, PrefillShapes, bucket_of
from dflash_train.speculative.loop import DecodeResult, Round
from dflash_train.speculative.rounds import Launched, Row, commit_round
from dflash_train.speculative.static_drafter import DraftSource, StaticDrafter, drafter_like
from dflash_train.utils.compile import compile_in_place
from dflash_train.utils.device import sync

log = logging.getLogger(__name__)


class SpecEngine:
    """Greedy speculative decoding of `target` with `drafter` over `slots` static slots.

    `drafter`: a DFlashDrafter (run in the target's device and dtype: `drafter_like`), any
    `DraftSource`, or None (plain greedy only).
    `max_len`: cache positions per slot; a prompt needs len + max_new_tokens + B of them.
    `draft_window`: decode the DFlashDrafter's full-attention layers with this sliding window
    (speculative/static_drafter.py): its context is then a ring of ~W + 2B positions per slot and
    a draft costs the same at any context length; the drafts change, the outputs never do.
    `overlap_rounds`: launch round r+1 before reading round r (module doc); outputs and rounds
    are the same either way. A plain attribute: it may change between runs."""

    def __init__(
        self,
        target: torch.nn.Module,
        drafter: DFlashDrafter | DraftSource | None,
        stop_ids: set[int] | Sequence[int],
        *,
        slots: int = 1,
        max_len: int = 2048,
        cuda_graphs: bool = True,
        compile: bool = False,
        refill_fraction: float = 0.125,
        prefill_tokens: int = 16384,
        attention: AttentionKind | Literal["auto"] = "auto",
        draft_window: int | None = None,
        overlap_rounds: bool = True,
    ) -> None:
        dev = target.get_input_embeddings().weight.device
        if attention == "auto":
            # FlexAttention at batch 1 on a GPU: latency-bound, and it saves the layout copies and
            # mask kernels that made a round 0.71x a greedy step (0.76x with it, SmolLM2 on an
            # H200); batched, cuDNN's SDPA is faster (28.4K vs 23.9K greedy tok/s at 64 slots).
            # The fused kernel needs torch.compile and heads of >= 16 dims (decode_attention_for).
            heads = [head_dim_of(target), getattr(getattr(drafter, "config", None), "head_dim", None)]
            attention = decode_attention_for(dev, compile, heads) if slots == 1 else "dense"
        self.attention = attention
        max_len = -(-max_len // FLEX_BLOCK) * FLEX_BLOCK
        block = drafter.config.block_size if isinstance(drafter, DFlashDrafter) else \
            drafter.block_size if drafter is not None else 1
        self.decoder = static_decoder(target, slots, max_len, attention=attention, width=block)  # rings fit a block
        self.device = dev
        self.slots, self.max_len = slots, max_len
        self.stop_ids = {int(t) for t in stop_ids}
        if isinstance(drafter, DFlashDrafter):
            drafter = StaticDrafter(drafter_like(drafter, self.decoder.embed_w), self.decoder.embed_w,
                                    self.decoder.lm_head_w, slots, max_len, attention=attention,
                                    window=draft_window)
        self.drafter = drafter
        self.block_size = block
        self.tap_layers = list(drafter.target_layer_ids) if drafter is not None else []
        self.refill = RefillRule.of(slots, refill_fraction)
        self.overlap_rounds = overlap_rounds
        self._allocate_slot_state(slots, dev)
        self.buckets = step_buckets(attention, max_len)
        self._commit: Callable[..., None] = commit_round
        graphs = cuda_graphs and dev.type == "cuda" and self.decoder.capturable and (drafter is None or isinstance(drafter, StaticDrafter))
        self._build_steps(graphs, prefill_tokens)
        self._marks = [DeviceMarks(dev, 3), DeviceMarks(dev, 3)]  # by launch parity: two rounds in flight
        self._rows: list[Row | None] = [None] * slots
        self._free: list[int] = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        if compile and dev.type == "cuda":
            self._compile_layer_functions()
        log.info("speculative engine: %d slots x %d positions, block %d, %s attention, %s", slots, max_len,
                 self.block_size, attention, "CUDA graphs" if graphs else "eager")

    def _allocate_slot_state(self, slots: int, dev: torch.device) -> None:
        """Per-slot state, static device buffers (see module doc), and the host copies of a round's report."""
        B, long = self.block_size, dict(dtype=torch.long, device=dev)
        self.tokens = torch.zeros(slots, **long)  # last committed token
        self.positions = torch.zeros(slots, **long)  # its position
        self.n_out = torch.zeros(slots, **long)  # tokens generated so far
        self.limit = torch.ones(slots, **long)  # max_new_tokens
        self.active = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.drafts = torch.zeros(slots, max(B - 1, 1), **long)
        self.block_start = torch.zeros(slots, **long)  # where the block verified last starts
        taps_width = len(self.tap_layers) * self.decoder.embed_w.shape[1]
        self.taps = torch.zeros(slots, B, taps_width, dtype=self.decoder.dtype, device=dev)
        self.stop_table = torch.tensor(sorted(self.stop_ids) or [-1], **long)  # -1 never matches
        self.columns = torch.arange(B, **long)
        # What a round reports to the host: greedy tokens [B], input token, committed, accepted, drafted.
        self.report = torch.zeros(slots, B + 4, **long)
        # greedy: top-1 logit and margin of the round's token, then of the prefill's
        self.top2 = torch.zeros(slots, 4, dtype=torch.float32, device=dev)
        self._readback = Readback([((slots, B + 4), torch.long), ((slots, 4), torch.float32)], dev)

    def _build_steps(self, graphs: bool, prefill_tokens: int) -> None:
        """The round's steps, each captured per kv bucket: verify (B tokens a slot) and draft with
        a drafter, greedy (verify of one token) always; and the prefill, greedy or speculative
        (with the drafter's context), captured per padded chunk shape."""
        B, state = self.block_size, [self.tokens, self.positions, self.n_out, self.active]
        self._verify = {1: GraphedStep(lambda kv: self._verify_step(1, kv), state, use_graphs=graphs, name="greedy")}
        if self.drafter is not None:
            self._verify[B] = GraphedStep(lambda kv: self._verify_step(B, kv), state, use_graphs=graphs, name="verify")
            self._draft = GraphedStep(self._draft_step, [], use_graphs=graphs, name="draft")
        # a chunk's inputs: [slots, lengths, ids], its rows' limits
        shapes = PrefillShapes(self.slots, self.max_len, prefill_tokens, min_width=32)
        self.prefill = PrefillStage(shapes, self.device, values_per_row=1)
        self._prefill_steps = {mode: self.prefill.step(lambda shape, mode=mode: self._prefill_step(shape, mode),
                                                       use_graphs=graphs,
                                                       name=f"prefill ({'speculative' if mode else 'greedy'})")
                               for mode in ((False, True) if self.drafter is not None else (False,))}

    def refresh_drafter(self, source: DFlashDrafter) -> None:
        """Decode with the current weights of `source` (see StaticDrafter.refresh)."""
        if not isinstance(self.drafter, StaticDrafter):
            raise TypeError("only an engine built on a DFlashDrafter can refresh its weights")
        self.drafter.refresh(source)

    @property
    def rounds_launched(self) -> int:
        """Rounds launched since the engine was built (each a step of every slot, live or not)."""
        return self._readback.launches

    @property
    def use_graphs(self) -> bool:
        return all(step.use_graphs for step in self._steps())

    def _steps(self) -> list[GraphedStep]:
        return list(self._verify.values()) + ([self._draft] if self.drafter is not None else [])

    # --- the two captured steps ------------------------------------------------------------

    @torch.no_grad()
    def _draft_step(self, kv_len: int) -> None:
        self.drafter.extend(self.taps, self.block_start)
        self.drafts.copy_(self.drafter.propose(self.tokens, self.positions, kv_len))

    @torch.no_grad()
    def _verify_step(self, width: int, kv_len: int) -> None:
        """Verify `width` tokens per slot, accept greedily and commit, all on device."""
        inp = self.tokens[:, None] if width == 1 else torch.cat([self.tokens[:, None], self.drafts], 1)  # [S, T]
        taps = self.taps if width > 1 else None
        logits, _ = self.decoder.verify(inp, self.positions, kv_len, self.tap_layers if width > 1 else (), taps)
        self._commit(logits, self.drafts, self.tokens, self.positions, self.n_out, self.limit, self.active,
                     self.block_start, self.stop_table, self.columns, self.report, self.top2, width=width)

    # --- setup ------------------------------------------------------------------------------

    def _compile_layer_functions(self, backend: str = "inductor") -> None:
        """Fuse the elementwise work of the per-layer functions (as BuiltinEngine does), the
        logits heads and the acceptance; their shapes do not depend on the kv bucket, so each
        compiles once per step width. (The CPU tests run this with a non-fusing backend.)"""
        dec, dr = self.decoder, self.drafter
        swapped = [*((dec, name) for name in dec.verify_functions()), (self, "_commit")]
        if isinstance(dr, StaticDrafter):
            swapped += [(dr, name) for name in ("block_q", "context_kv", "post_attention", "head", "dspark_head")]

        def trace() -> None:  # all slots idle: the steps commit nothing
            for step in self._steps():
                step.fn(self.buckets[0])

        exc = compile_in_place(swapped, trace, self.device, backend=backend)
        if exc is not None:  # run uncompiled, dense attention
            warnings.warn(f"torch.compile of the engine's layers failed, running them uncompiled: {exc}", stacklevel=2)
            self._use_dense_attention()

    def _use_dense_attention(self) -> None:
        """Back to SDPA with a dense mask (generate/attention.py) when FlexAttention cannot compile."""
        if self.attention == "dense":
            return
        self.attention = "dense"
        use_dense_attention(*(p for p in (self.decoder, self.drafter) if isinstance(p, (StaticDecoder, StaticDrafter))))
        self.buckets = step_buckets("dense", self.max_len)

    @torch.no_grad()
    def warm_up(self, max_kv: int | None = None) -> None:
        """Capture every step's CUDA graph for every kv bucket up to `max_kv` now, so no
        capture lands inside a timed run. Only between runs (all slots idle)."""
        if self._n_active():
            raise RuntimeError("warm_up needs an idle engine")
        last = bucket_of(min(max_kv, self.max_len), self.buckets) if max_kv else self.max_len
        for kv in [b for b in self.buckets if b <= last]:
            for step in self._steps():
                step(kv)
        # the prefill steps of every chunk shape up to max_kv tokens a row (the stage's slots are
        # zero: every row writes idle slot 0, harmless)
        for shape in self.prefill.shapes.every_shape(max_kv):
            for step in self._prefill_steps.values():
                step(shape)
        self.prefill.buffer.zero_()
        self.active.zero_()  # the prefill step set slot 0's flag from a stale limit
        sync(self.device)

    def _n_active(self) -> int:
        return self.slots - len(self._free)

    # --- decoding ---------------------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, *, speculative: bool = True) -> DecodeResult:
        """Greedy decoding of one prompt; speculative unless `speculative` is False."""
        return self.generate_batch([prompt_ids], max_new_tokens, speculative=speculative)[0]

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        speculative: bool = True,
        on_result: Callable[[int, DecodeResult], None] | None = None,
    ) -> list[DecodeResult]:
        """Decode every prompt (in order, refilling slots as sequences finish); results in
        prompt order. Per prompt, `seconds` runs from its prefill to the host's read of its
        last round (a round launched behind it is not counted; the run waits for it before
        returning), `prefill_seconds` is the prefill's device time."""
        self._check_prompts(prompts, max_new_tokens, speculative)
        width = self.block_size if speculative else 1
        results: list[DecodeResult | None] = [None] * len(prompts)
        pending = deque(enumerate(prompts))

        def admit() -> int:
            if not self.refill.due(len(self._free), len(pending)):
                return 0
            batch = pull(lambda: pending.popleft() if pending else None, len(self._free))
            for chunk in self.prefill.chunks(batch, length=lambda item: len(item[1])):
                self._prefill(chunk, max_new_tokens, speculative)
            return len(batch)

        def finish(slot: int, reason: str) -> None:
            index, result = self._finish(slot, reason)
            results[index] = result
            if on_result is not None:
                on_result(index, result)

        sync(self.device)
        run_one_step_ahead(admit, lambda: self._launch(width, speculative),
                           lambda launched: self._collect(launched, finish), lambda: self._n_active() > 0,
                           overlap=self.overlap_rounds)
        return results  # type: ignore[return-value]

    def _check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, speculative: bool) -> None:
        if speculative and self.drafter is None:
            raise ValueError("this engine has no drafter: use speculative=False")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        for p in prompts:
            if not p:
                raise ValueError("empty prompt")
            if len(p) + max_new_tokens + self.block_size > self.max_len:
                raise ValueError(f"a prompt of {len(p)} tokens + {max_new_tokens} new needs max_len >= "
                                 f"{len(p) + max_new_tokens + self.block_size}, this engine has {self.max_len}")

    def _finish(self, slot: int, reason: str) -> tuple[int, DecodeResult]:
        """Free `slot`; its row's prompt index and result."""
        row = self._rows[slot]
        assert row is not None
        self._rows[slot] = None
        self._free.append(slot)
        greedy = row.greedy
        return row.index, DecodeResult(row.out, row.rounds, reason, time.perf_counter() - row.t_start,
                                       row.prefill_seconds, row.draft_seconds, row.verify_seconds,
                                       row.margins if greedy else None, row.top_logits if greedy else None)

    def _prefill(self, chunk: list[tuple[int, Sequence[int]]], max_new: int, speculative: bool) -> None:
        """Prefill of a chunk of prompts into free slots (a captured step per padded shape),
        queued behind the rounds in flight; no host synchronisation (module doc)."""
        t0 = time.perf_counter()
        marks = DeviceMarks(self.device, 2)
        slots = [self._free.pop() for _ in chunk]
        marks.mark(0)
        shape, _ = self.prefill.put(slots, [p for _, p in chunk], columns=[[max_new] * len(chunk)])
        self._prefill_steps[speculative](shape)
        marks.mark(1)
        for slot, (index, prompt) in zip(slots, chunk):
            self._rows[slot] = Row(index, len(prompt), max_new, len(prompt), t0, marks, greedy=not speculative)

    @torch.no_grad()
    def _prefill_step(self, shape: tuple[int, int], speculative: bool) -> None:
        """The chunk staged at `shape` into its slots."""
        slot_idx, lengths, ids = self.prefill.views(shape)
        (limits,) = self.prefill.columns(shape, 1)
        self._prefill_into(ids, lengths, limits, slot_idx, speculative)

    def _prefill_into(self, ids: Tensor, lengths: Tensor, limits: Tensor, slot_idx: Tensor, speculative: bool) -> None:
        """Prompts ids [n, T] (right padded to T, `lengths` [n], max_new_tokens `limits` [n]) into
        cache rows `slot_idx` [n] (the target's and, speculative, the drafter's context); each
        one's first token goes to `tokens`, its top-1 logit and margin to `top2`, and the slot's
        state starts there: active unless that token stops it or the limit is 1. No host sync."""
        if speculative:
            logits, taps = self.decoder.prefill_with_taps(ids, lengths, slot_idx, self.tap_layers)
            self.drafter.start(ids, lengths, slot_idx, taps)
        else:
            logits = self.decoder.prefill(ids, lengths, slot_idx)
        top = logits.float().topk(2, dim=-1).values  # [n, 2]
        first = logits.argmax(-1)
        self.tokens.index_copy_(0, slot_idx, first)
        self.top2[:, 2:].index_copy_(0, slot_idx, torch.stack([top[:, 0], top[:, 0] - top[:, 1]], 1))
        self.positions.index_copy_(0, slot_idx, lengths)
        self.block_start.index_copy_(0, slot_idx, lengths)  # stale taps land where the first block goes: overwritten
        self.n_out.index_fill_(0, slot_idx, 1)
        self.limit.index_copy_(0, slot_idx, limits)
        stopped = (first[:, None] == self.stop_table).any(-1)
        self.active.index_copy_(0, slot_idx, ~stopped & (limits > 1))

    def _launch(self, width: int, speculative: bool) -> Launched | None:
        """Queue one round for every slot and the copy of its report; None when no row needs it."""
        rows = [(s, row) for s, row in enumerate(self._rows) if row is not None and row.needs_round()]
        if not rows:
            return None
        # Each round in flight may commit a whole block before this one starts.
        need = max(row.position + row.in_flight * width for _, row in rows) + width
        kv_len = bucket_of(min(need, self.max_len), self.buckets)
        marks = self._marks[self._readback.parity]
        marks.mark(0)
        if speculative:
            self._draft(kv_len)
        marks.mark(1)
        self._verify[width](kv_len)
        marks.mark(2)
        for _, row in rows:
            row.in_flight += 1
        return Launched(rows, *self._copy_report(not speculative), marks)

    def _copy_report(self, with_top2: bool) -> tuple[Tensor, Tensor | None, object | None]:
        """The report (and top2) on their way to the host (Readback: by launch parity, with an
        event on CUDA), and that event."""
        report, top2 = self._readback.buffers()
        report.copy_(self.report, non_blocking=True)
        if with_top2:
            top2.copy_(self.top2, non_blocking=True)
        return report, (top2 if with_top2 else None), self._readback.sent()

    def _collect(self, launched: Launched, finish) -> None:
        """Read a round back and hand it to the rows still in their slots: a row that finished
        in an earlier round was stepped once more (committing nothing), and that is dropped."""
        report, top2 = launched.read()
        draft_s, verify_s = launched.marks.seconds(0, 1), launched.marks.seconds(1, 2)
        for s, row in launched.rows:
            row.in_flight -= 1
            if self._rows[s] is not row:
                continue
            if row.first_pending and self._first_token(s, row, report[s][-4], top2[s][2:] if top2 else None, finish):
                continue
            committed, accepted, drafted = report[s][-3:]
            tokens = report[s][:committed]
            row.out.extend(tokens)
            row.rounds.append(Round(drafted, accepted, committed))
            row.position += committed
            row.draft_seconds += draft_s
            row.verify_seconds += verify_s
            if top2 is not None:
                row.top_logits.append(top2[s][0])
                row.margins.append(top2[s][1])
            if tokens[-1] in self.stop_ids:
                finish(s, "stop")
            elif len(row.out) >= row.limit:
                finish(s, "length")

    def _first_token(self, slot: int, row: Row, token: int, top2: list[float] | None, finish) -> bool:
        """The prefill's token, read with the row's first round; True if it ended the row (the
        device then kept it inactive: that round committed nothing for it)."""
        row.first_pending = False
        row.prefill_seconds = row.prefill.seconds(0, 1)
        row.out.append(token)
        if top2 is not None:
            row.top_logits.append(top2[0])
            row.margins.append(top2[1])
        if token in self.stop_ids or row.limit == 1:
            finish(slot, "stop" if token in self.stop_ids else "length")
            return True
        return False
