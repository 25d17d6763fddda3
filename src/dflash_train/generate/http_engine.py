"""The HTTP engine: an OpenAI-compatible server (vLLM, SGLang, ...) that the user runs.

Chat prompts go to `POST {base_url}/chat/completions`; raw-text and token-id prompts (used
to let the target write a user turn) go to `POST {base_url}/completions`. Only the
standard library is used: a thread pool keeps at most `concurrency` requests in flight.

Failure policy, chosen so a long run neither dies of a hiccup nor silently produces nothing:
- connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff and
  jitter; when the retries run out the whole run stops with an error naming the server;
- HTTP 400/413/422 concern one request (say, a prompt over the server's context length):
  that conversation is skipped and reported, the run goes on;
- any other 4xx (wrong URL, missing auth, unknown model) and answers that are not
  well-formed OpenAI JSON stop the run at once: retrying cannot fix them.
Rows already written are never lost; rerunning the same command resumes.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from dflash_train.generate.engine import Completion, NextRequest, OnComplete, Request
from dflash_train.utils.errors import DFlashError

log = logging.getLogger(__name__)

_REQUEST_ERRORS = (400, 413, 422)


class HttpEngineError(DFlashError):
    """The server is unreachable or answers in a way that retrying cannot fix."""


class _Retryable(Exception):
    pass


def normalize_base_url(url: str) -> str:
    """`http://host:8000` -> `http://host:8000/v1`; a URL with a path is kept as given."""
    url = url.strip().rstrip("/")
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"base_url must look like http://HOST:PORT/v1, got {url!r}")
    return url if parsed.path else url + "/v1"


def _excerpt(raw: bytes | str, n: int = 300) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = " ".join(text.split())
    return text if len(text) <= n else text[:n] + "..."


class HttpEngine:
    name = "http"

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        concurrency: int = 32,
        retries: int = 5,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        timeout_s: float = 600.0,
        api_key: str | None = None,
    ) -> None:
        if concurrency < 1 or retries < 0:
            raise ValueError("concurrency must be >= 1 and retries >= 0")
        self.base_url = normalize_base_url(base_url)
        self.concurrency, self.retries = concurrency, retries
        self.backoff_s, self.max_backoff_s, self.timeout_s = backoff_s, max_backoff_s, timeout_s
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self._model = model
        self._stop = threading.Event()

    # --- plumbing -----------------------------------------------------------------------

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        """One HTTP exchange with retries; returns the decoded JSON answer."""
        url = self.base_url + path
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))
                if self._stop.wait(delay * random.uniform(0.5, 1.0)):  # jitter spreads retries out
                    break
            try:
                return self._exchange(method, url, data, headers)
            except _Retryable as exc:
                last = str(exc)
                log.debug("attempt %d/%d for %s failed: %s", attempt + 1, self.retries + 1, url, last)
        raise HttpEngineError(
            f"no usable answer from {url} after {self.retries + 1} attempts (last: {last}); is the "
            f"OpenAI-compatible server (vLLM, SGLang) running and --base_url right?"
        )

    def _exchange(self, method: str, url: str, data: bytes | None, headers: dict) -> Any:
        req = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read() if exc.fp is not None else b""
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise _Retryable(f"cannot connect: {reason}") from None
        if status == 429 or status >= 500:
            raise _Retryable(f"HTTP {status}: {_excerpt(raw)}")
        if status in _REQUEST_ERRORS:
            return _RequestRejected(status, _excerpt(raw))
        if status != 200:
            raise HttpEngineError(f"{url} answered HTTP {status}: {_excerpt(raw)}")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HttpEngineError(
                f"{url} answered HTTP 200 with a body that is not JSON: {_excerpt(raw)!r}; "
                "is this an OpenAI-compatible endpoint?"
            ) from None

    # --- API ----------------------------------------------------------------------------

    @property
    def model(self) -> str:
        """The served model: as configured, else the first one `GET /models` lists."""
        if self._model is None:
            answer = self._call("GET", "/models")
            try:
                self._model = str(answer["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise HttpEngineError(
                    f"{self.base_url}/models did not list a model ({_excerpt(json.dumps(answer))}); pass --model"
                ) from None
        return self._model

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "model": self.model, "base_url": self.base_url}

    def complete(self, request: Request) -> Completion:
        """One request, blocking. Raises HttpEngineError for failures that end the run."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_new_tokens,
            "temperature": request.sampling.temperature,
            "top_p": request.sampling.top_p,
            "seed": request.key,  # servers that honour it make sampled rows reproducible
        }
        if request.sampling.top_k > 0:
            body["top_k"] = request.sampling.top_k  # a vLLM/SGLang extension to the OpenAI API
        if request.messages is not None:
            path, body["messages"] = "/chat/completions", request.messages
        else:
            path, body["prompt"] = "/completions", request.text if request.text is not None else request.prompt_ids
        answer = self._call("POST", path, body)
        if isinstance(answer, _RequestRejected):
            return Completion(finish_reason="error", error=f"server rejected the request: HTTP {answer}")
        return self._parse(answer, path)

    def _parse(self, answer: Any, path: str) -> Completion:
        where = f"{self.base_url}{path}"
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise HttpEngineError(f"{where}: the answer has no 'choices': {_excerpt(json.dumps(answer))}") from None
        if not isinstance(choice, dict):
            raise HttpEngineError(f"{where}: 'choices[0]' is not an object: {_excerpt(json.dumps(answer))}")
        if path == "/chat/completions":
            text = (choice.get("message") or {}).get("content")
        else:
            text = choice.get("text")
        if text is None:
            return Completion(finish_reason="error", error=f"{where}: the answer has no text: {_excerpt(json.dumps(choice))}")
        if not isinstance(text, str):
            raise HttpEngineError(f"{where}: the answer's text is not a string: {_excerpt(json.dumps(choice))}")
        usage = answer.get("usage") or {}
        finish = choice.get("finish_reason") or "stop"
        return Completion(
            text,
            "length" if finish == "length" else "stop",
            new_tokens=int(usage.get("completion_tokens") or 0),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
        )

    def run(self, next_request: NextRequest, on_complete: OnComplete) -> None:
        _ = self.model  # resolve (and check the server) before anything is sent
        self._stop.clear()
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="dflash-http")
        inflight: dict[Future, Request] = {}
        try:
            while True:
                while len(inflight) < self.concurrency:
                    req = next_request()
                    if req is None:
                        break
                    inflight[pool.submit(self.complete, req)] = req
                if not inflight:
                    return
                done, _ = wait(inflight, return_when=FIRST_COMPLETED)
                for fut in done:
                    req = inflight.pop(fut)
                    on_complete(req, fut.result())  # a fatal HttpEngineError surfaces here
        finally:
            # On failure: stop retry loops and queued work; requests on the wire finish alone.
            self._stop.set()
            pool.shutdown(wait=False, cancel_futures=True)


class _RequestRejected(str):
    """HTTP status and body excerpt of an answer that rejects one request (400/413/422)."""

    def __new__(cls, status: int, body: str) -> "_RequestRejected":
        return super().__new__(cls, f"{status}: {body}")
