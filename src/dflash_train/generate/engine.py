"""The interface both engines implement.

An engine pulls requests when it has room and reports each completion through a callback:

    engine.run(next_request, on_complete)

`next_request()` returns a Request, or None when nothing is ready *now*; `on_complete` may
make new requests ready (the next turn of a conversation), so an engine keeps asking after
every completion and stops only when `next_request()` is None and nothing is in flight.
This pull model lets a multi-turn conversation feed its next turn back into a running
batch, and keeps at most a batch's worth of work in memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from dflash_train.generate.sampling import Sampling


@dataclass
class Request:
    """One generation from exactly one kind of prompt: a chat (`messages`, templated by the
    engine or server), raw text to continue (`text`, how the target writes a user turn), or
    token ids (`prompt_ids`, for benchmarks and tests)."""

    messages: list[dict[str, str]] | None = None
    text: str | None = None
    prompt_ids: list[int] | None = None
    sampling: Sampling = Sampling()
    max_new_tokens: int = 256
    key: int = 0  # 32-bit sampling key; the same key gives the same sampled tokens
    tag: Any = None  # the caller's bookkeeping, handed back untouched

    def __post_init__(self) -> None:
        if sum(p is not None for p in (self.messages, self.text, self.prompt_ids)) != 1:
            raise ValueError("a Request needs exactly one of messages, text, prompt_ids")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    """What the target wrote. `finish_reason` is "stop" (end of turn), "length" (hit
    max_new_tokens) or "error" (this request failed on its own; `error` says why, and the
    run goes on without it)."""

    text: str = ""
    finish_reason: str = "stop"
    new_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    token_ids: list[int] | None = None  # the built-in engine's new tokens (without the stop token)

    @property
    def ok(self) -> bool:
        return self.error is None


NextRequest = Callable[[], "Request | None"]
OnComplete = Callable[[Request, Completion], None]


class Engine(Protocol):
    name: str

    def run(self, next_request: NextRequest, on_complete: OnComplete) -> None: ...

    def describe(self) -> dict[str, Any]:
        """What to record about the engine in every output row (model name, engine kind)."""
        ...
