"""The built-in engine: continuous batching over a static KV cache, in this process.

`slots` conversations decode together, one token each per step. When a row stops (an
end-of-turn token or its token limit) its slot is handed the next prompt while the others
keep going, so the batch stays full. The decode step has a fixed shape, so on a GPU it is
captured once in a CUDA graph (per attention-length bucket) and replayed: one launch per
step instead of ~1,000 small kernel launches, which is what limits Hugging Face `generate`
for small models. Its elementwise parts can also be fused by torch.compile.

On CPU the very same step runs eagerly; that is what the exactness tests check against
Hugging Face greedy decoding.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from dflash_train.generate.attention import AttentionKind, decode_attention_for, use_dense_attention
from dflash_train.generate.continuous_batching import (
    DeviceMarks,
    PrefillStage,
    Readback,
    RefillRule,
    pull,
    run_one_step_ahead,
    step_buckets,
    wait_for,
)
from dflash_train.generate.decoder import head_dim_of
from dflash_train.generate.hybrid_decoder import static_decoder
from dflash_train.generate.engine import Completion, NextRequest, OnComplete, Request
from dflash_train.generate.graphs import GraphedStep, PrefillShapes, bucket_of
from dflash_train.generate.sampling import select_tokens
from dflash_train.generate.sizing import cache_positions
from dflash_train.generate.slots import SlotTable
from dflash_train.target.chat_template import stop_token_ids
from dflash_train.utils.compile import compile_in_place
from dflash_train.utils.device import to_device_async

log = logging.getLogger(__name__)

# a refill's prompts are prefilled in length-sorted chunks of at most this many (padded) tokens
PREFILL_TOKENS = 16384
# a prefill chunk is padded to a power of two of rows and of tokens a row (at least this many),
# so that few shapes serve every chunk: each a captured step on CUDA
PREFILL_MIN_WIDTH = 64

def decode_rows(tokenizer, rows: list[list[int]]) -> list[str]:
    """Each row's text, as `tokenizer.decode(row, skip_special_tokens=False,
    clean_up_tokenization_spaces=False)` gives it. A fast tokenizer's Rust backend decodes the
    batch in one call (in parallel); `batch_decode` would only loop over `decode` in Python."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and rows:
        return backend.decode_batch(rows, skip_special_tokens=False)
    return [tokenizer.decode(row, skip_special_tokens=False, clean_up_tokenization_spaces=False) for row in rows]


@dataclass
class EngineStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    completed: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    slot_steps_active: int = 0  # sum over steps of active slots: utilisation = this / (steps * slots)
    prefill_forwards: int = 0  # one per length-sorted chunk of an admission
    prefill_padded_tokens: int = 0  # rows x width of those chunks, padded to their shapes
    prefill_captures: int = 0  # chunk shapes captured as CUDA graphs (each once, on first use)
    prefill_capture_seconds: float = 0.0  # the host's seconds capturing them (in host_prefill_seconds)
    # The host's own time (the one thread that also launches every step): pulling and
    # tokenising prompts, issuing prefills, handing finished rows back (detokenising, the
    # callback). On a GPU the step in flight hides it only while it is shorter than the step.
    host_admit_seconds: float = 0.0
    host_prefill_seconds: float = 0.0
    host_finish_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass
class _Row:
    request: Request
    prompt_len: int


@dataclass
class _Launched:
    owners: np.ndarray  # the row in each slot when the step was launched (SlotTable.take)
    tokens: np.ndarray  # the step's tokens [slots]: a view of a pinned host buffer on CUDA
    # The first tokens of the rows prefilled since the previous launch (their slots' step
    # inputs [slots]) and those rows as `owners`; None when there were none.
    first: np.ndarray | None
    first_owners: np.ndarray | None
    prefills: list[DeviceMarks]  # the device time of those prefills (CUDA)
    event: Any  # CUDA event after the copies into the host buffer; None on CPU


class BuiltinEngine:
    """Generate with a Hugging Face model loaded in this process (see module doc)."""

    name = "builtin"

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        slots: int = 64,
        max_prompt_tokens: int = 1024,
        max_new_tokens: int = 512,
        stop_ids: set[int] | None = None,
        ignore_eos: bool = False,
        cuda_graphs: bool = True,
        compile: bool = False,
        prefill_tokens: int = PREFILL_TOKENS,
        refill_fraction: float = 0.125,
        attention: AttentionKind | Literal["auto"] = "auto",
        model_name: str = "",
    ) -> None:
        if slots < 1 or max_prompt_tokens < 1 or max_new_tokens < 1:
            raise ValueError("slots, max_prompt_tokens and max_new_tokens must be >= 1")
        self.model, self.tokenizer = model, tokenizer
        self.slots, self.max_prompt_tokens, self.max_new_tokens = slots, max_prompt_tokens, max_new_tokens
        self.stop_ids = set(stop_ids) if stop_ids is not None else stop_token_ids(tokenizer, model)
        if not self.stop_ids and not ignore_eos:
            log.warning("no end-of-sequence token known: every row will run to max_new_tokens")
        self.ignore_eos = ignore_eos
        self.refill = RefillRule.of(slots, refill_fraction)
        self.model_name = model_name or getattr(getattr(model, "config", None), "name_or_path", "") or ""
        self.stats = EngineStats()

        if attention == "auto":
            attention = decode_attention_for(model.get_input_embeddings().weight.device, compile, [head_dim_of(model)])
        max_len = cache_positions(max_prompt_tokens, max_new_tokens, attention)  # whole attention blocks
        self.attention = attention
        self.decoder = static_decoder(model, slots, max_len, attention=attention)
        self.device = dev = self.decoder.device
        self._allocate_slot_state(slots, dev)
        if compile and dev.type == "cuda":
            self._compile_layer_functions()
        graphs = cuda_graphs and dev.type == "cuda" and self.decoder.capturable
        self.buckets = step_buckets(self.attention, max_len)
        self.step = GraphedStep(lambda kv_len: self.decoder.decode(self.tokens, self.positions, kv_len),
                                use_graphs=graphs, name="decode")
        # a chunk's inputs: [slots, lengths, ids], its rows' top-k and keys, the rows that sample
        self.prefill = PrefillStage(PrefillShapes(slots, max_prompt_tokens, prefill_tokens, PREFILL_MIN_WIDTH),
                                    dev, values_per_row=3)
        self.prefill_step = self.prefill.step(self._prefill_forward, use_graphs=graphs, name="prefill")
        log.info("built-in engine: %d slots x %d positions, KV cache %.2f GiB, %s attention, %s", slots, max_len,
                 self.decoder.kv_bytes() / 2**30, self.attention, "CUDA graphs" if self.step.use_graphs else "eager")

    def _allocate_slot_state(self, slots: int, dev: torch.device) -> None:
        """Per-slot state the decode step and token selection read, all static device buffers,
        and the host's: its rows, their tokens (SlotTable), the slots that sample (greedy rows
        skip the sampling work)."""
        self._rows: list[_Row | None] = [None] * slots
        self.table = SlotTable(slots, self.max_new_tokens, () if self.ignore_eos else self.stop_ids)
        self._readback = Readback([((2, slots), torch.long)], dev)  # a step's inputs and its tokens
        self._fresh: list[int] = []  # slots prefilled since the last launch: their first token is read with it
        self._prefill_marks: list[DeviceMarks] = []  # of the prefills queued since the last launch (CUDA)
        long = dict(dtype=torch.long, device=dev)
        self.tokens = torch.zeros(slots, **long)
        self.positions = torch.zeros(slots, **long)
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(slots, **long)
        self.keys = torch.zeros(slots, **long)
        self.steps = torch.zeros(slots, **long)
        self._sampling: set[int] = set()  # slots whose rows sample (temperature > 0)
        self._sampling_index: Tensor | None = None  # sorted(_sampling) on the device, rebuilt when it changes
        self._n_filtered = 0  # rows in slots that sample with top-k or top-p

    # --- setup ------------------------------------------------------------------------

    def _compile_layer_functions(self, backend: str = "inductor") -> None:
        """Fuse the elementwise work around the matmuls (norms, RoPE, SiLU*up, residuals).
        Only the decode step's per-layer functions (and, with flex, the logits head) are
        compiled: their shapes do not depend on the attention length, so one compilation serves
        every layer and every kv bucket. Prefill stays eager: its chunks come in many shapes
        (compiled for dynamic shapes, they recompiled on new shapes and layouts, seconds each),
        and each shape is a captured step anyway. (The CPU tests run this with a non-fusing
        backend to check that it traces as one graph per function and never recompiles.)"""
        dec = self.decoder
        names = dec.decode_functions()

        def trace() -> None:  # all slots are idle: the k/v it writes at their position 0 are overwritten by prefill
            dec.decode(self.tokens, self.positions, dec.max_len)

        exc = compile_in_place([(dec, name) for name in names], trace, self.device, backend=backend)
        if exc is not None:  # run uncompiled, dense attention
            warnings.warn(f"torch.compile of the decode step failed, running it uncompiled with dense attention: "
                          f"{exc}", stacklevel=2)
            self.attention = "dense"
            use_dense_attention(dec)

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "model": self.model_name}

    def encode(self, request: Request) -> list[int]:
        """Prompt token ids: the chat template with the assistant header, or raw text.
        The rendered template already holds any BOS, so no special tokens are added."""
        return self.encode_many([request])[0]

    def encode_many(self, requests: list[Request]) -> list[list[int]]:
        """`encode` of each request, the texts tokenised in one call: a fast tokenizer encodes
        a batch in parallel, where one call per prompt costs ~0.3 ms of the host each (a
        1,536-slot engine admits a few hundred prompts at a time)."""
        ids: list[list[int] | None] = [None if r.prompt_ids is None else list(r.prompt_ids) for r in requests]
        todo = [i for i, r in enumerate(requests) if r.prompt_ids is None]
        if todo and self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: give requests as prompt_ids")
        texts = [self._prompt_text(requests[i]) for i in todo]
        if texts:
            for i, row in zip(todo, self.tokenizer(texts, add_special_tokens=False)["input_ids"]):
                ids[i] = list(row)
        return ids  # type: ignore[return-value] - every entry is filled

    def _prompt_text(self, request: Request) -> str:
        if request.messages is not None:
            return self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        return request.text

    # --- the loop -----------------------------------------------------------------------

    @torch.no_grad()
    def run(self, next_request: NextRequest, on_complete: OnComplete) -> None:
        """Decode until `next_request` has nothing and every row is done: the continuous-batching
        loop of generate/continuous_batching.py, one step ahead of the host. A prefill's first
        tokens are not read on their own (that would drain the pipeline): they are the next
        step's inputs and come back with that step's tokens."""
        run_one_step_ahead(
            admit=lambda: self._admit(next_request, on_complete) if self.refill.due(len(self.table.free)) else 0,
            launch=lambda: self._launch() if self._n_active() else None,
            collect=lambda launched: self._collect(launched, on_complete),
            busy=lambda: self._n_active() > 0,
        )

    def _n_active(self) -> int:
        return self.table.n_active

    def _admit(self, next_request: NextRequest, on_complete: OnComplete) -> int:
        """Pull requests into the free slots and prefill them; returns how many were pulled."""
        t0, prefill_s = time.perf_counter(), self.stats.host_prefill_seconds
        pulled = pull(next_request, len(self.table.free))
        batch: list[tuple[Request, list[int]]] = []
        for req, ids in zip(pulled, self.encode_many(pulled)):
            if not ids or len(ids) > self.max_prompt_tokens:
                problem = "empty prompt" if not ids else f"prompt has {len(ids)} tokens > max_prompt_tokens={self.max_prompt_tokens}"
                on_complete(req, Completion(finish_reason="error", prompt_tokens=len(ids), error=problem))
                continue
            batch.append((req, ids))
        for chunk in self.prefill.chunks(batch, length=lambda item: len(item[1])):
            self._prefill(chunk)
        self.stats.host_admit_seconds += time.perf_counter() - t0 - (self.stats.host_prefill_seconds - prefill_s)
        return len(pulled)

    def _prefill_forward(self, shape: tuple[int, int]) -> Tensor:
        """The prefill of the chunk staged (by `_prefill`) at `shape`."""
        slot_idx, lengths, ids = self.prefill.views(shape)
        return self.decoder.prefill(ids, lengths, slot_idx)

    def _to_device(self, values: list, dtype: torch.dtype) -> Tensor:
        return to_device_async(torch.tensor(values, dtype=dtype), self.device)

    def _prefill(self, chunk: list[tuple[Request, list[int]]]) -> None:
        """Prefill `chunk` into free slots and choose each row's first token, without waiting
        for the device: the first tokens are read back with the next step (`_launch`)."""
        t0 = time.perf_counter()
        marks = DeviceMarks(self.device, 2)
        marks.mark(0)
        n, reqs = len(chunk), [req for req, _ in chunk]
        slots = [self.table.occupy(len(ids), min(req.max_new_tokens, self.max_new_tokens)) for req, ids in chunk]
        for slot, (req, prompt) in zip(slots, chunk):
            self._rows[slot] = _Row(req, len(prompt))
            self._track_sampling(slot, req, True)
        # two host-to-device copies per chunk (integers into the stage, floats) rather than one per field
        sampling_at = [i for i, req in enumerate(reqs) if not req.sampling.greedy]  # rows that sample
        shape, staged = self.prefill.put(slots, [p for _, p in chunk], tail=sampling_at, columns=(
            [r.sampling.top_k for r in reqs], [r.key & 0xFFFFFFFF for r in reqs]))
        slot_idx, lengths, _ = (view[:n] for view in self.prefill.views(shape))
        top_k, keys = self.prefill.columns(shape, 2)[:, :n]
        floats = self._to_device([r.sampling.temperature for r in reqs] + [r.sampling.top_p for r in reqs],
                                 torch.float32)
        self.temperature[slot_idx], self.top_p[slot_idx] = floats[:n], floats[n:]
        self.top_k[slot_idx], self.keys[slot_idx] = top_k, keys
        self.steps[slot_idx] = 0

        logits = self.prefill_step(shape)[:n]
        self.tokens[slot_idx] = self._select(logits, slot_idx, staged[-len(sampling_at):] if sampling_at else None)
        self.positions[slot_idx] = lengths
        self.steps[slot_idx] = 1
        self._fresh.extend(slots)
        self._count_prefill(chunk, shape, t0, marks)

    def _count_prefill(self, chunk: list[tuple[Request, list[int]]], shape: tuple[int, int], t0: float,
                       marks: DeviceMarks) -> None:
        st = self.stats
        st.prompt_tokens += sum(len(p) for _, p in chunk)
        st.prefill_padded_tokens += shape[0] * shape[1]
        st.prefill_captures = self.prefill_step.captured
        st.prefill_capture_seconds = self.prefill_step.capture_seconds
        st.prefill_forwards += 1
        st.host_prefill_seconds += time.perf_counter() - t0
        if marks.cuda:  # pragma: no cover - the device time is read when the next step is
            marks.mark(1)
            self._prefill_marks.append(marks)
        else:  # eager on CPU: the host time is the prefill's
            st.prefill_seconds += time.perf_counter() - t0

    def _track_sampling(self, slot: int, request: Request, occupied: bool) -> None:
        """Keep the set of slots whose rows sample, and the count of those that filter: greedy
        rows skip the sampling work, and a batch without top-k/top-p the sort."""
        s = request.sampling
        if s.greedy:
            return
        (self._sampling.add if occupied else self._sampling.discard)(slot)
        self._sampling_index = None
        self._n_filtered += (1 if occupied else -1) * (s.top_k > 0 or s.top_p < 1.0)

    def _select(self, logits: Tensor, slots: Tensor | None = None, sampling_at: Tensor | None = None) -> Tensor:
        """Next tokens for `logits` [n, V], the rows of `slots` (every slot when None): the argmax,
        and Gumbel-max sampling on the rows that sample (positions `sampling_at` among the n;
        for every slot, the slots of `_sampling`) alone. Per row these are the tokens of sampling
        the whole batch, without the noise, the scaling and the sort over every greedy row's
        vocabulary: most rows are greedy answers, a few sample (synthesised user turns)."""
        greedy = logits.argmax(dim=-1)
        if slots is None and self._sampling:
            if self._sampling_index is None:
                self._sampling_index = self._to_device(sorted(self._sampling), torch.long)
            sampling_at = self._sampling_index
        if sampling_at is None:
            return greedy
        at = sampling_at if slots is None else slots[sampling_at]  # the sampling rows' slots
        sampled = select_tokens(
            logits[sampling_at], self.temperature[at], self.top_p[at], self.top_k[at], self.keys[at], self.steps[at],
            any_sampled=True, any_filtered=self._n_filtered > 0,
        )  # fmt: skip
        return greedy.index_copy(0, sampling_at, sampled)

    def _launch(self) -> "_Launched":
        """Queue one decode step for every slot; returns what `_collect` needs to read it."""
        t0 = time.perf_counter()
        kv_needed, owners = self.table.launch()
        fresh, self._fresh = self._fresh, []
        prefills, self._prefill_marks = self._prefill_marks, []
        (host,) = self._readback.buffers()
        if fresh:  # the prefilled rows' first tokens are this step's inputs
            host[0].copy_(self.tokens, non_blocking=True)
        logits = self.step(bucket_of(kv_needed, self.buckets))
        nxt = self._select(logits)
        self.tokens.copy_(nxt)
        # Idle slots keep stepping on stale input; clamping keeps their positions in range.
        self.positions.add_(1).clamp_(max=self.decoder.max_len - 1)
        self.steps.add_(1)
        host[1].copy_(nxt, non_blocking=True)  # async into pinned memory on CUDA
        event = self._readback.sent()
        self.stats.decode_steps += 1
        self.stats.slot_steps_active += self.table.n_active
        first_owners = None
        if fresh:
            first_owners = np.full(self.slots, -1, dtype=np.int64)
            first_owners[fresh] = owners[fresh]
        view = host.numpy()
        self.stats.decode_seconds += time.perf_counter() - t0
        return _Launched(owners, view[1], view[0] if fresh else None, first_owners, prefills, event)

    def _collect(self, launched: "_Launched", on_complete: OnComplete) -> None:
        """Read a launched step's tokens back (after the first tokens of the rows prefilled
        before it) and hand them to the rows still in their slots."""
        t0 = time.perf_counter()
        wait_for(launched.event)
        # The wait covers the prefills queued before the step: their device time is prefill's.
        prefill_s = sum(marks.seconds(0, 1) for marks in launched.prefills)
        self.stats.prefill_seconds += prefill_s
        self.stats.decode_seconds += max(time.perf_counter() - t0 - prefill_s, 0.0)
        if launched.first is not None:
            self._deliver(launched.first, launched.first_owners, on_complete)
        self._deliver(launched.tokens, launched.owners, on_complete)

    def _deliver(self, tokens: np.ndarray, owners: np.ndarray, on_complete: OnComplete) -> None:
        ended, stopped = self.table.take(tokens, owners)
        if len(ended):
            t0 = time.perf_counter()
            self._finish(ended.tolist(), ["stop" if stop else "length" for stop in stopped.tolist()], on_complete)
            self.stats.host_finish_seconds += time.perf_counter() - t0

    def _finish(self, slots: list[int], reasons: list[str], on_complete: OnComplete) -> None:
        """Free `slots` and hand each row's completion to `on_complete`, in slot order; the
        texts are detokenised in one call (`decode_rows`)."""
        rows, outs = [], []
        for slot in slots:
            row = self._rows[slot]
            assert row is not None
            self._rows[slot] = None
            outs.append(self.table.release(slot))
            self._track_sampling(slot, row.request, False)
            rows.append(row)
        texts = decode_rows(self.tokenizer, outs) if self.tokenizer is not None else [""] * len(outs)
        for row, out, text, reason in zip(rows, outs, texts, reasons):
            new_tokens = len(out) + (reason == "stop")
            self.stats.new_tokens += new_tokens
            self.stats.completed += 1
            on_complete(
                row.request,
                Completion(text, reason, new_tokens=new_tokens, prompt_tokens=row.prompt_len, token_ids=out),
            )
