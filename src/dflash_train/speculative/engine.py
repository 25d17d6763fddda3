"""Greedy speculative decoding (and its plain greedy baseline) on the static-KV engine.

One engine serves generation and evaluation, batch 1 (latency) or many sequences at once.
Every slot holds one sequence; all per-slot state lives in static device buffers
(last committed token, its position, tokens generated, limit, active flag). A round:

    draft step   (one CUDA graph per kv bucket)
        drafter.extend(taps of the block verified last round)   context K/V at their positions
        drafts = drafter.propose(last token, position)          [slots, B-1]
    verify step  (one CUDA graph per kv bucket)
        logits, taps = target.verify([last, drafts], position)  [slots, B, V], [slots, B, n*H]
        greedy acceptance on device: a = longest prefix of drafts equal to the target's argmax
        (capped so the output never passes max_new_tokens), commit a + 1 tokens, cut after a
        stop token; update position / last token / count / active flag in place
    one small copy to the host: the committed tokens and counts (the round's report)

Pipelined rounds (`overlap_rounds`, on by default). Every input of a round is already on the
device, so round r+1 is launched before the host reads round r's report, as the generate
engine does with its decode steps: the GPU never idles through the host's wake-up, copy,
bookkeeping and the next launches. The kv bucket of round r+1 allows for round r committing
a whole block; a row that finished in round r (the device already stopped committing for it)
took part in round r+1, whose report for it is discarded; refills land a round later. A
prompt costs no host synchronisation either: its ids, length and limit go to the device in
one copy, its active flag is computed there, and its first token comes back with the report
of its first round.

Plain greedy decoding is the same verify step with T = 1 and no drafter; it also returns
each token's top-1 logit and top-1 minus top-2 margin, for the lossless check in
speculative/decoders.py.

Batched mode schedules like the built-in generate engine: a slot whose sequence finished
(on device it just stops committing) is refilled with the next prompt while the others
keep decoding. Refills wait until `refill_fraction` of the slots are free (or the queue
is shorter than that, or nothing is running), so one prefill serves several prompts (a chunk
padded to one of a few shapes, each a captured step on CUDA, as in generate/builtin.py).
Every slot's rounds depend only on its own sequence, so a prompt commits exactly what it
commits at batch 1 (up to kernel rounding in bf16).

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
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence

import torch
from torch import Tensor

from dflash_train.drafter.model import DFlashDrafter
from dflash_train.generate.attention import FLEX_BLOCK, AttentionKind, decode_attention_for, use_dense_attention
from dflash_train.generate.decoder import StaticDecoder, head_dim_of
from dflash_train.generate.graphs import GraphedStep, PrefillShapes, kv_buckets
from dflash_train.speculative.loop import DecodeResult, Round
from dflash_train.speculative.static_drafter import DraftSource, StaticDrafter, drafter_like
from dflash_train.utils.device import copy_values_async

log = logging.getLogger(__name__)


class _Marks:
    """Device time between marks (a round's draft and verify, a prefill): CUDA events on a GPU,
    read once the work is known to be done (no extra wait); the wall clock on CPU, where every
    op is synchronous."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(n)] if self.cuda else []
        self.marks = [0.0] * n

    def mark(self, i: int) -> None:
        if self.cuda:  # pragma: no cover
            self.events[i].record()
        else:
            self.marks[i] = time.perf_counter()

    def seconds(self, i: int, j: int) -> float:
        """Seconds from mark i to mark j; call after the work behind mark j has completed."""
        if self.cuda:  # pragma: no cover
            return self.events[i].elapsed_time(self.events[j]) / 1000
        return self.marks[j] - self.marks[i]


@dataclass(eq=False)
class _Row:
    """Host record of the sequence in a slot."""

    index: int  # in the caller's prompt list
    prompt_len: int
    limit: int  # max_new_tokens
    position: int  # of the last committed token (as read back so far)
    t_start: float
    prefill: _Marks  # its device time, read with the first round
    greedy: bool
    first_pending: bool = True  # the prefill's token is read back with the row's first round
    in_flight: int = 0  # rounds launched for this row and not read back yet
    prefill_seconds: float = 0.0
    out: list[int] = field(default_factory=list)
    rounds: list[Round] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)
    top_logits: list[float] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def needs_round(self) -> bool:
        """Whether a new round can still commit for this row. Each round in flight commits at
        least one token while the row is active, so once the tokens known plus the rounds in
        flight reach the limit, those rounds finish it. A row whose first token is unread
        needs one round to bring it back."""
        if self.first_pending and not self.in_flight:
            return True
        return len(self.out) + self.first_pending + self.in_flight < self.limit


@dataclass
class _Launched:
    """A round on its way: the rows it reports for, and where its report lands."""

    rows: list[tuple[int, _Row]]  # (slot, row) as at the launch
    report: Tensor  # host copy of the report [slots, B + 4] (pinned on CUDA)
    top2: Tensor | None  # host copy of top2 [slots, 4] (plain greedy only)
    event: object | None  # CUDA event after the copies; None on CPU
    marks: _Marks

    def read(self) -> tuple[list[list[int]], list[list[float]] | None]:
        if self.event is not None:  # pragma: no cover - CUDA only: wait for this round alone
            self.event.synchronize()
        return self.report.tolist(), (self.top2.tolist() if self.top2 is not None else None)


def commit_round(
    logits: Tensor, drafts: Tensor, tokens: Tensor, positions: Tensor, n_out: Tensor, limit: Tensor, active: Tensor,
    block_start: Tensor, stop_table: Tensor, columns: Tensor, report: Tensor, top2: Tensor, *, width: int,
) -> None:  # fmt: skip
    """Greedy acceptance of a verified block and the commit, in place on the engine's state
    (module doc). logits [S, T, V] of the block [last token, drafts[:, :T-1]] (T = `width`).
    One function so that torch.compile fuses its few dozen tiny ops into a few kernels.
    report [S, B + 4]: the target's choices, the round's input token (a new row's first
    token comes back this way), committed, accepted, drafted; top2 [S, 4]: this token's top-1
    logit and margin (plain greedy), then the prefill's (written there)."""
    greedy = logits.argmax(-1)  # [S, T]: greedy[:, k] is the target's choice after input k
    report[:, -4].copy_(tokens)
    if width > 1:
        block_start.copy_(positions)  # the taps just written start here: the drafter's next context
        drafted = (limit - n_out - 1).clamp(0, width - 1)  # never draft past max_new_tokens
        match = (drafts == greedy[:, :-1]).long().cumprod(1).sum(1)
        accepted = torch.minimum(match, drafted)
    else:
        drafted = accepted = torch.zeros_like(n_out)
        top = logits[:, 0].float().topk(2, dim=-1).values  # [S, 2]
        top2[:, :2].copy_(torch.stack([top[:, 0], top[:, 0] - top[:, 1]], 1))
    # The accepted drafts equal greedy[:, :a], so the commit is greedy[:, :a + 1], cut after a stop token.
    candidate = accepted + 1
    is_stop = (greedy[..., None] == stop_table).any(-1) & (columns[None, :width] < candidate[:, None])
    stopped = is_stop.any(1)
    first_stop = torch.where(stopped, is_stop.long().argmax(1), width)
    committed = torch.minimum(candidate, first_stop + 1) * active
    n_out.add_(committed)
    last = greedy.gather(1, (committed - 1).clamp(min=0)[:, None])[:, 0]
    tokens.copy_(torch.where(committed > 0, last, tokens))
    active.logical_and_(~(stopped | (n_out >= limit)))
    # Finished slots keep stepping (on stale input, committing nothing) until refilled, at
    # position 0: in range, and every query of theirs sees at least its own block.
    positions.add_(committed).mul_(active)
    report[:, :width].copy_(greedy)
    report[:, -3:].copy_(torch.stack([committed, accepted, drafted], 1))


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
        self.decoder = StaticDecoder(target, slots, max_len, attention=attention)
        self.device = dev
        self.slots, self.max_len = slots, max_len
        self.stop_ids = {int(t) for t in stop_ids}
        if isinstance(drafter, DFlashDrafter):
            drafter = StaticDrafter(drafter_like(drafter, self.decoder.embed_w), self.decoder.embed_w,
                                    self.decoder.lm_head_w, slots, max_len, attention=attention,
                                    window=draft_window)
        self.drafter = drafter
        self.block_size = drafter.block_size if drafter is not None else 1
        self.tap_layers = list(drafter.target_layer_ids) if drafter is not None else []
        self.refill_min = max(1, int(slots * refill_fraction))
        self.overlap_rounds = overlap_rounds
        B = self.block_size

        self._allocate_slot_state(slots, dev)

        # Dense attention reads cache positions [0, bucket); flex reads by blocks whatever the bucket.
        self.buckets = kv_buckets(max_len) if attention == "dense" else [max_len]
        self._commit: Callable[..., None] = commit_round
        graphs = cuda_graphs and dev.type == "cuda" and (drafter is None or isinstance(drafter, StaticDrafter))
        state = [self.tokens, self.positions, self.n_out, self.active]
        self._verify = {1: GraphedStep(lambda kv: self._verify_step(1, kv), state, use_graphs=graphs, name="greedy")}
        if drafter is not None:
            self._verify[B] = GraphedStep(lambda kv: self._verify_step(B, kv), state, use_graphs=graphs, name="verify")
            self._draft = GraphedStep(self._draft_step, [], use_graphs=graphs, name="draft")
        # The prefill too is a captured step, one per padded chunk shape (generate/graphs.py,
        # PrefillShapes: padding rows repeat the chunk's first row, so their writes are its bytes;
        # prompts right padded, which causal attention never lets them see), so a chunk costs a
        # graph replay, not ~1,900 eager launches (~20-40 ms of the host for SmolLM2 on an H200).
        # Its inputs, [slots, lengths, ids, limits], arrive in `prefill_stage` by one copy.
        self.prefill_shapes = PrefillShapes(slots, max_len, prefill_tokens, min_width=32)
        rows_cap = self.prefill_shapes.rows[-1]
        self.prefill_stage = torch.zeros(3 * rows_cap + self.prefill_shapes.budget, dtype=torch.long, device=dev)
        self._prefill_steps = {mode: GraphedStep(lambda shape, mode=mode: self._prefill_step(shape, mode), [],
                                                 use_graphs=graphs, shared_pool=True,
                                                 name=f"prefill ({'speculative' if mode else 'greedy'})",
                                                 describe=lambda key: "%d x %d tokens" % key)
                               for mode in ((False, True) if drafter is not None else (False,))}
        self._marks = [_Marks(dev, 3), _Marks(dev, 3)]  # by launch parity: two rounds in flight
        self._launches = 0
        self._rows: list[_Row | None] = [None] * slots
        self._free: list[int] = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        if compile and dev.type == "cuda":
            self._compile_layer_functions()
        log.info("speculative engine: %d slots x %d positions, block %d, %s attention, %s", slots, max_len, B,
                 attention, "CUDA graphs" if graphs else "eager")

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
        pinned = dev.type == "cuda"  # two of each: one for the round in flight, one being read
        self._report_host = [torch.zeros(slots, B + 4, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self._top2_host = [torch.zeros(slots, 4, dtype=torch.float32, pin_memory=pinned) for _ in range(2)]

    def refresh_drafter(self, source: DFlashDrafter) -> None:
        """Decode with the current weights of `source` (see StaticDrafter.refresh)."""
        if not isinstance(self.drafter, StaticDrafter):
            raise TypeError("only an engine built on a DFlashDrafter can refresh its weights")
        self.drafter.refresh(source)

    @property
    def rounds_launched(self) -> int:
        """Rounds launched since the engine was built (each a step of every slot, live or not)."""
        return self._launches

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
        swapped = [(dec, "q_writing_kv"), (dec, "post_attention"), (dec, "final_logits"), (self, "_commit")]
        if isinstance(dr, StaticDrafter):
            swapped += [(dr, name) for name in ("block_q", "context_kv", "post_attention", "head", "dspark_head")]
        plain = [getattr(owner, name) for owner, name in swapped]
        for (owner, name), fn in zip(swapped, plain):
            setattr(owner, name, torch.compile(fn, backend=backend, dynamic=False, fullgraph=True))
        try:  # compile now (all slots idle: the steps commit nothing), so a failure falls back cleanly
            for step in self._steps():
                step.fn(self.buckets[0])
            self._sync()
        except Exception as exc:  # noqa: BLE001 - any compiler failure: run uncompiled, dense attention
            warnings.warn(f"torch.compile of the engine's layers failed, running them uncompiled: {exc}", stacklevel=2)
            for (owner, name), fn in zip(swapped, plain):
                setattr(owner, name, fn)
            self._use_dense_attention()

    def _use_dense_attention(self) -> None:
        """Back to SDPA with a dense mask (generate/attention.py) when FlexAttention cannot compile."""
        if self.attention == "dense":
            return
        self.attention = "dense"
        use_dense_attention(*(p for p in (self.decoder, self.drafter) if isinstance(p, (StaticDecoder, StaticDrafter))))
        self.buckets = kv_buckets(self.max_len)

    @torch.no_grad()
    def warm_up(self, max_kv: int | None = None) -> None:
        """Capture every step's CUDA graph for every kv bucket up to `max_kv` now, so no
        capture lands inside a timed run. Only between runs (all slots idle)."""
        if self._n_active():
            raise RuntimeError("warm_up needs an idle engine")
        last = next((b for b in self.buckets if b >= max_kv), self.max_len) if max_kv else self.max_len
        for kv in [b for b in self.buckets if b <= last]:
            for step in self._steps():
                step(kv)
        # the prefill steps of every chunk shape up to max_kv tokens a row (the stage's slots are
        # zero: every row writes idle slot 0, harmless)
        shapes = self.prefill_shapes
        widest = next((w for w in shapes.widths if w >= max_kv), shapes.widths[-1]) if max_kv else shapes.widths[-1]
        for width in [w for w in shapes.widths if w <= widest]:
            for rows in [r for r in shapes.rows if r * width <= shapes.budget or r == 1]:
                for step in self._prefill_steps.values():
                    step((rows, width))
        self.prefill_stage.zero_()
        self.active.zero_()  # the prefill step set slot 0's flag from a stale limit
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":  # pragma: no cover
            torch.cuda.synchronize()

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
        if speculative and self.drafter is None:
            raise ValueError("this engine has no drafter: use speculative=False")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        width = self.block_size if speculative else 1
        for p in prompts:
            if not p:
                raise ValueError("empty prompt")
            if len(p) + max_new_tokens + self.block_size > self.max_len:
                raise ValueError(f"a prompt of {len(p)} tokens + {max_new_tokens} new needs max_len >= "
                                 f"{len(p) + max_new_tokens + self.block_size}, this engine has {self.max_len}")
        results: list[DecodeResult | None] = [None] * len(prompts)
        pending = deque(enumerate(prompts))

        def finish(slot: int, reason: str) -> None:
            row = self._rows[slot]
            assert row is not None
            self._rows[slot] = None
            self._free.append(slot)
            res = DecodeResult(row.out, row.rounds, reason, time.perf_counter() - row.t_start, row.prefill_seconds,
                               row.draft_seconds, row.verify_seconds,
                               row.margins if row.greedy else None, row.top_logits if row.greedy else None)
            results[row.index] = res
            if on_result is not None:
                on_result(row.index, res)

        self._sync()
        unread: _Launched | None = None  # the round launched last, not read back yet
        while pending or self._n_active() or unread is not None:
            free = len(self._free)
            if pending and free and (free >= min(self.refill_min, len(pending)) or not self._n_active()):
                self._admit([pending.popleft() for _ in range(min(free, len(pending)))], max_new_tokens, speculative)
            launched = self._launch(width, speculative)
            if unread is not None:
                self._collect(unread, finish)
            unread = launched
            if unread is not None and not self.overlap_rounds:
                self._collect(unread, finish)
                unread = None
        return results  # type: ignore[return-value]

    def _admit(self, batch: list[tuple[int, Sequence[int]]], max_new: int, speculative: bool) -> None:
        batch = sorted(batch, key=lambda item: len(item[1]))
        for start, end in self.prefill_shapes.chunks([len(p) for _, p in batch]):  # length-sorted, padded
            self._prefill(batch[start:end], max_new, speculative)

    def _prefill(self, chunk: list[tuple[int, Sequence[int]]], max_new: int, speculative: bool) -> None:
        """Prefill of a chunk of prompts into free slots (a captured step per padded shape),
        queued behind the rounds in flight; no host synchronisation (module doc)."""
        t0 = time.perf_counter()
        marks = _Marks(self.device, 2)
        slots = [self._free.pop() for _ in chunk]
        marks.mark(0)
        shape, values = self.prefill_shapes.staged(slots, [p for _, p in chunk])
        values += [max_new] * shape[0]  # the limits, after the staged ids
        copy_values_async(self.prefill_stage[: len(values)], values)
        self._prefill_steps[speculative](shape)
        marks.mark(1)
        for slot, (index, prompt) in zip(slots, chunk):
            self._rows[slot] = _Row(index, len(prompt), max_new, len(prompt), t0, marks, greedy=not speculative)

    @torch.no_grad()
    def _prefill_step(self, shape: tuple[int, int], speculative: bool) -> None:
        """The chunk in `prefill_stage`, padded to `shape`, into its slots."""
        slot_idx, lengths, ids = self.prefill_shapes.views(self.prefill_stage, shape)
        limits = self.prefill_stage[PrefillShapes.staged_size(shape):].narrow(0, 0, shape[0])
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

    def _launch(self, width: int, speculative: bool) -> _Launched | None:
        """Queue one round for every slot and the copy of its report; None when no row needs it."""
        rows = [(s, row) for s, row in enumerate(self._rows) if row is not None and row.needs_round()]
        if not rows:
            return None
        # Each round in flight may commit a whole block before this one starts.
        need = max(row.position + row.in_flight * width for _, row in rows) + width
        kv_len = next(b for b in self.buckets if b >= min(need, self.max_len))
        marks = self._marks[self._launches % 2]
        marks.mark(0)
        if speculative:
            self._draft(kv_len)
        marks.mark(1)
        self._verify[width](kv_len)
        marks.mark(2)
        for _, row in rows:
            row.in_flight += 1
        return _Launched(rows, *self._copy_report(not speculative), marks)

    def _copy_report(self, with_top2: bool) -> tuple[Tensor, Tensor | None, object | None]:
        """The report (and top2) on their way to the host: pinned buffers by launch parity and
        an event on CUDA; copies on CPU, as the next round overwrites the device's."""
        parity = self._launches % 2
        self._launches += 1
        if self.device.type != "cuda":
            return self.report.clone(), (self.top2.clone() if with_top2 else None), None
        report, top2 = self._report_host[parity], self._top2_host[parity]  # pragma: no cover - CUDA only
        report.copy_(self.report, non_blocking=True)
        if with_top2:
            top2.copy_(self.top2, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return report, (top2 if with_top2 else None), event

    def _collect(self, launched: _Launched, finish) -> None:
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

    def _first_token(self, slot: int, row: _Row, token: int, top2: list[float] | None, finish) -> bool:
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
