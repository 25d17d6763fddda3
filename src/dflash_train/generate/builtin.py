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
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from dflash_train.generate.attention import FLEX_BLOCK, AttentionKind, decode_attention_for, use_dense_attention
from dflash_train.generate.decoder import StaticDecoder
from dflash_train.generate.engine import Completion, NextRequest, OnComplete, Request
from dflash_train.generate.graphs import GraphedStep, kv_buckets
from dflash_train.generate.sampling import select_tokens
from dflash_train.target.chat_template import stop_token_ids

log = logging.getLogger(__name__)

@dataclass
class EngineStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    completed: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    slot_steps_active: int = 0  # sum over steps of active slots: utilisation = this / (steps * slots)

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


@dataclass(eq=False)
class _Row:
    request: Request
    prompt_len: int
    limit: int
    next_pos: int = 0  # position of the next decode input of this row (launched, not yet read)
    out: list[int] = field(default_factory=list)


@dataclass
class _Launched:
    rows: list[_Row | None]  # each slot's row when the step was launched
    active: list[int]
    host: Tensor  # the step's tokens [slots]: a pinned host buffer on CUDA
    event: Any  # CUDA event after the copy into `host`; None on CPU


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
        prefill_tokens: int = 16384,
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
        self.prefill_tokens = max(prefill_tokens, max_prompt_tokens)
        # Refill once this many slots are free: one prefill per handful of finished rows
        # instead of one per row (each prefill is a full eager forward).
        self.refill_min = max(1, int(slots * refill_fraction))
        self.model_name = model_name or getattr(getattr(model, "config", None), "name_or_path", "") or ""
        self.stats = EngineStats()

        if attention == "auto":
            attention = decode_attention_for(model.get_input_embeddings().weight.device, compile)
        # flex reads the cache in 128-key blocks, so its length is a whole number of blocks
        multiple = FLEX_BLOCK if attention == "flex" else 64
        max_len = -(-(max_prompt_tokens + max_new_tokens) // multiple) * multiple
        self.attention = attention
        self.decoder = StaticDecoder(model, slots, max_len, attention=attention)
        dev = self.decoder.device
        self.device = dev
        # Per-slot state the decode step and token selection read, all static device buffers.
        self.tokens = torch.zeros(slots, dtype=torch.long, device=dev)
        self.positions = torch.zeros(slots, dtype=torch.long, device=dev)
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(slots, dtype=torch.long, device=dev)
        self.keys = torch.zeros(slots, dtype=torch.long, device=dev)
        self.steps = torch.zeros(slots, dtype=torch.long, device=dev)
        if compile and dev.type == "cuda":
            self._compile_layer_functions()
        # Dense attention reads cache positions [0, bucket) of every slot, the bucket set by the
        # longest row; flex reads each slot's own blocks whatever the bucket: one step for all.
        self.buckets = kv_buckets(max_len) if self.attention == "dense" else [max_len]
        self.step = GraphedStep(lambda kv_len: self.decoder.decode(self.tokens, self.positions, kv_len),
                                use_graphs=cuda_graphs and dev.type == "cuda", name="decode")
        self._rows: list[_Row | None] = [None] * slots
        # two pinned buffers: one for the step in flight, one for the step being read
        self._host_buffers = (
            [torch.empty(slots, dtype=torch.long, pin_memory=True) for _ in range(2)] if dev.type == "cuda" else []
        )
        self._launches = 0
        self._free: list[int] = list(range(slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._any_sampled = self._any_filtered = self._flags_dirty = False
        log.info(
            "built-in engine: %d slots x %d positions, KV cache %.2f GiB, %s attention, %s",
            slots, max_len, self.decoder.kv_bytes() / 2**30, self.attention,
            "CUDA graphs" if self.step.use_graphs else "eager",
        )  # fmt: skip

    # --- setup ------------------------------------------------------------------------

    def _compile_layer_functions(self, backend: str = "inductor") -> None:
        """Fuse the elementwise work around the matmuls (norms, RoPE, SiLU*up, residuals).
        Only the per-layer functions (and, with flex, the logits head) are compiled: their
        shapes do not depend on the attention length, so one compilation serves every layer
        and every kv bucket. (The CPU tests run this with a non-fusing backend to check that
        it traces as one graph per function and never recompiles.)"""
        dec = self.decoder
        # dense decode: pre_attention + SDPA + post_attention; flex decode = `verify` of one
        # token: q_writing_kv + FlexAttention + post_attention + final_logits
        names = ("q_writing_kv", "post_attention", "final_logits") if self.attention == "flex" \
            else ("pre_attention", "post_attention")
        originals = {name: getattr(dec, name) for name in names}
        try:  # compile now, with the exact inputs of a step, so any failure falls back cleanly
            for name in names:
                setattr(dec, name, torch.compile(originals[name], backend=backend, dynamic=False, fullgraph=True))
            with torch.no_grad():  # as in `run`: grad mode is part of what compiled code is keyed on
                # all slots are idle: the k/v this writes at their position 0 are overwritten by prefill
                dec.decode(self.tokens, self.positions, dec.max_len)
            if dec.device.type == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - any compiler failure: run uncompiled, dense attention
            warnings.warn(f"torch.compile of the decode step failed, running it uncompiled with dense attention: "
                          f"{exc}", stacklevel=2)
            for name, fn in originals.items():
                setattr(dec, name, fn)
            self.attention = "dense"
            use_dense_attention(dec)

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "model": self.model_name}

    def encode(self, request: Request) -> list[int]:
        """Prompt token ids: the chat template with the assistant header, or raw text.
        The rendered template already holds any BOS, so no special tokens are added."""
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: give requests as prompt_ids")
        if request.messages is not None:
            text = self.tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        else:
            text = request.text
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    # --- the loop -----------------------------------------------------------------------

    @torch.no_grad()
    def run(self, next_request: NextRequest, on_complete: OnComplete) -> None:
        """Decode until `next_request` has nothing and every row is done.

        The loop runs one step ahead of the host: step t is launched before the tokens of
        step t-1 are read back, so the GPU never waits for the Python bookkeeping. A row
        that stops at t-1 was therefore also stepped at t; that token is discarded (the
        slot's row is compared with the one it held at launch). Prompts are admitted only
        into slots known to be free, and their prefill is queued after the in-flight step,
        so stream order keeps every slot's cache and inputs consistent."""
        pending: _Launched | None = None
        while True:
            pulled = 0
            if len(self._free) >= self.refill_min or (self._n_active() == 0 and pending is None):
                pulled = self._admit(next_request, on_complete)
            if self._n_active() == 0 and pending is None:
                if pulled:
                    continue  # everything pulled finished at once (errors, 1-token rows)
                return
            launched = self._launch() if self._n_active() else None
            if pending is not None:
                self._collect(pending, on_complete)
            pending = launched

    def _n_active(self) -> int:
        return self.slots - len(self._free)

    def _admit(self, next_request: NextRequest, on_complete: OnComplete) -> int:
        """Pull requests into the free slots and prefill them; returns how many were pulled."""
        batch: list[tuple[Request, list[int]]] = []
        pulled = 0
        while len(batch) < len(self._free):
            req = next_request()
            if req is None:
                break
            pulled += 1
            ids = self.encode(req)
            if not ids or len(ids) > self.max_prompt_tokens:
                problem = "empty prompt" if not ids else f"prompt has {len(ids)} tokens > max_prompt_tokens={self.max_prompt_tokens}"
                on_complete(req, Completion(finish_reason="error", prompt_tokens=len(ids), error=problem))
                continue
            batch.append((req, ids))
        batch.sort(key=lambda item: len(item[1]))
        start = 0
        while start < len(batch):  # length-sorted chunks within the prefill token budget
            end = start + 1
            while end < len(batch) and (end + 1 - start) * len(batch[end][1]) <= self.prefill_tokens:
                end += 1
            self._prefill(batch[start:end], on_complete)
            start = end
        return pulled

    def _to_device(self, values: list, dtype: torch.dtype) -> Tensor:
        t = torch.tensor(values, dtype=dtype)
        if self.device.type == "cuda":  # pragma: no cover - pinned memory makes the copy async
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def _prefill(self, chunk: list[tuple[Request, list[int]]], on_complete: OnComplete) -> None:
        t0 = time.perf_counter()
        width = max(len(ids) for _, ids in chunk)
        slots = [self._free.pop() for _ in chunk]
        slot_idx = self._to_device(slots, torch.long)
        lengths = self._to_device([len(ids) for _, ids in chunk], torch.long)
        ids = self._to_device([ids + [0] * (width - len(ids)) for _, ids in chunk], torch.long)
        reqs = [req for req, _ in chunk]
        self.temperature[slot_idx] = self._to_device([r.sampling.temperature for r in reqs], torch.float32)
        self.top_p[slot_idx] = self._to_device([r.sampling.top_p for r in reqs], torch.float32)
        self.top_k[slot_idx] = self._to_device([r.sampling.top_k for r in reqs], torch.long)
        self.keys[slot_idx] = self._to_device([r.key & 0xFFFFFFFF for r in reqs], torch.long)
        self.steps[slot_idx] = 0
        for slot, (req, prompt) in zip(slots, chunk):
            limit = min(req.max_new_tokens, self.max_new_tokens)
            self._rows[slot] = _Row(req, len(prompt), limit, next_pos=len(prompt))
        self._flags_dirty = True

        logits = self.decoder.prefill(ids, lengths, slot_idx)
        first = self._select(logits, slot_idx)
        self.tokens[slot_idx] = first
        self.positions[slot_idx] = lengths
        self.steps[slot_idx] = 1
        first_host = first.tolist()  # also waits for the GPU, so the timing below is real
        self.stats.prefill_seconds += time.perf_counter() - t0
        self.stats.prompt_tokens += sum(len(p) for _, p in chunk)
        for slot, token in zip(slots, first_host):
            self._append(slot, token, on_complete)

    def _select(self, logits: Tensor, rows: Tensor | None = None) -> Tensor:
        if self._flags_dirty:
            self._update_flags()
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        return select_tokens(
            logits, pick(self.temperature), pick(self.top_p), pick(self.top_k), pick(self.keys), pick(self.steps),
            any_sampled=self._any_sampled, any_filtered=self._any_filtered,
        )  # fmt: skip

    def _update_flags(self) -> None:
        self._flags_dirty = False
        samplings = [row.request.sampling for row in self._rows if row is not None]
        self._any_sampled = any(not s.greedy for s in samplings)
        self._any_filtered = any(not s.greedy and (s.top_k > 0 or s.top_p < 1.0) for s in samplings)

    def _launch(self) -> "_Launched":
        """Queue one decode step for every slot; returns what `_collect` needs to read it."""
        t0 = time.perf_counter()
        rows = list(self._rows)
        active = [s for s, row in enumerate(rows) if row is not None]
        kv_needed = 1 + max(rows[s].next_pos for s in active)  # type: ignore[union-attr]
        for s in active:
            rows[s].next_pos += 1  # type: ignore[union-attr]
        logits = self.step(next(b for b in self.buckets if b >= kv_needed))
        nxt = self._select(logits)
        self.tokens.copy_(nxt)
        # Idle slots keep stepping on stale input; clamping keeps their positions in range.
        self.positions.add_(1).clamp_(max=self.decoder.max_len - 1)
        self.steps.add_(1)
        event = None
        if self.device.type == "cuda":  # pragma: no cover - async copy into pinned memory
            host = self._host_buffers[self._launches % 2]
            host.copy_(nxt, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = nxt
        self._launches += 1
        self.stats.decode_steps += 1
        self.stats.slot_steps_active += len(active)
        self.stats.decode_seconds += time.perf_counter() - t0
        return _Launched(rows, active, host, event)

    def _collect(self, launched: "_Launched", on_complete: OnComplete) -> None:
        """Read a launched step's tokens back and hand them to the rows still in their slots."""
        t0 = time.perf_counter()
        if launched.event is not None:  # pragma: no cover - CUDA only
            launched.event.synchronize()
        tokens = launched.host.tolist()
        self.stats.decode_seconds += time.perf_counter() - t0
        for slot in launched.active:
            row = launched.rows[slot]
            if self._rows[slot] is row:  # else the row stopped at the previous step
                self._append(slot, tokens[slot], on_complete)

    def _append(self, slot: int, token: int, on_complete: OnComplete) -> None:
        row = self._rows[slot]
        assert row is not None
        stop = token in self.stop_ids and not self.ignore_eos
        if not stop:
            row.out.append(token)
        if stop or len(row.out) >= row.limit:
            self._finish(slot, "stop" if stop else "length", on_complete)

    def _finish(self, slot: int, reason: str, on_complete: OnComplete) -> None:
        row = self._rows[slot]
        assert row is not None
        self._rows[slot] = None
        self._free.append(slot)
        self._flags_dirty = True  # recomputed once before the next token selection
        new_tokens = len(row.out) + (reason == "stop")
        self.stats.new_tokens += new_tokens
        self.stats.completed += 1
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(row.out, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        on_complete(
            row.request,
            Completion(text, reason, new_tokens=new_tokens, prompt_tokens=row.prompt_len, token_ids=row.out),
        )
