"""The HTTP engine against a small local server speaking the OpenAI protocol."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_train.generate.engine import Request
from dflash_train.generate.http_engine import HttpEngine, HttpEngineError, normalize_base_url
from dflash_train.generate.sampling import Sampling


def ok_answer(path: str, body: dict) -> tuple[int, bytes]:
    if path.endswith("/chat/completions"):
        text = "echo: " + body["messages"][-1]["content"]
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
    else:
        choice = {"index": 0, "text": "a user request", "finish_reason": "length"}
    answer = {"id": "x", "object": "chat.completion", "choices": [choice], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}
    return 200, json.dumps(answer).encode()


class FakeServer:
    """`script` answers (path, body, n-th request) -> (status, body bytes)."""

    def __init__(self) -> None:
        self.script = lambda path, body, n: ok_answer(path, body)
        self.requests: list[tuple[str, dict]] = []
        self.inflight = self.max_inflight = 0
        self.lock = threading.Lock()
        self.delay = 0.0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, payload: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):  # noqa: N802
                self._send(200, json.dumps({"object": "list", "data": [{"id": "served-model"}]}).encode())

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.requests.append((self.path, body))
                    n = len(fake.requests)
                    fake.inflight += 1
                    fake.max_inflight = max(fake.max_inflight, fake.inflight)
                time.sleep(fake.delay)
                status, payload = fake.script(self.path, body, n)
                with fake.lock:
                    fake.inflight -= 1
                self._send(status, payload)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()


@pytest.fixture
def server():
    fake = FakeServer()
    yield fake
    fake.httpd.shutdown()
    fake.httpd.server_close()


def engine_for(url: str, **kw) -> HttpEngine:
    return HttpEngine(url, kw.pop("model", "m"), retries=kw.pop("retries", 3), backoff_s=0.01, timeout_s=5, **kw)


CHAT = Request(messages=[{"role": "user", "content": "hi"}], sampling=Sampling(0.7, 0.9, 20), max_new_tokens=9, key=42)


def test_chat_and_completion_requests(server):
    engine = engine_for(server.url, model=None)
    assert engine.model == "served-model"  # from GET /v1/models
    done = engine.complete(CHAT)
    assert (done.text, done.finish_reason, done.new_tokens, done.prompt_tokens) == ("echo: hi", "stop", 3, 7)
    path, body = server.requests[-1]
    assert path == "/v1/chat/completions"
    assert body == {"model": "served-model", "messages": CHAT.messages, "max_tokens": 9, "temperature": 0.7,
                    "top_p": 0.9, "top_k": 20, "seed": 42}
    done = engine.complete(Request(text="<|im_start|>user\n", max_new_tokens=5))
    assert (done.text, done.finish_reason) == ("a user request", "length")
    path, body = server.requests[-1]
    assert path == "/v1/completions" and body["prompt"] == "<|im_start|>user\n" and "top_k" not in body


@pytest.mark.parametrize("status", [500, 503, 429])
def test_transient_failures_are_retried(server, status):
    server.script = lambda path, body, n: (status, b"busy") if n < 3 else ok_answer(path, body)
    assert engine_for(server.url).complete(CHAT).text == "echo: hi"
    assert len(server.requests) == 3


def test_giving_up_after_retries_names_the_server(server):
    server.script = lambda path, body, n: (500, b"internal error")
    with pytest.raises(HttpEngineError, match=r"after 3 attempts \(last: HTTP 500: internal error\)"):
        engine_for(server.url, retries=2).complete(CHAT)
    assert len(server.requests) == 3


def test_unreachable_server_is_a_clear_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(HttpEngineError, match=rf"127.0.0.1:{port}/v1/chat/completions after 3 attempts .*cannot connect"):
        engine_for(url, retries=2).complete(CHAT)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"<html>Bad gateway</html>", "not JSON"),
        (json.dumps({"object": "error"}).encode(), "no 'choices'"),
        (json.dumps({"choices": []}).encode(), "no 'choices'"),
        (json.dumps({"choices": [{"message": {"content": 5}}]}).encode(), "not a string"),
    ],
)
def test_malformed_answers_stop_the_run(server, payload, message):
    server.script = lambda path, body, n: (200, payload)
    with pytest.raises(HttpEngineError, match=message):
        engine_for(server.url).complete(CHAT)
    assert len(server.requests) == 1  # retrying cannot fix a malformed answer


def test_client_errors(server):
    server.script = lambda path, body, n: (404, b'{"error": "model not found"}')
    with pytest.raises(HttpEngineError, match="HTTP 404"):
        engine_for(server.url).complete(CHAT)
    server.script = lambda path, body, n: (400, b'{"error": "prompt too long"}')
    done = engine_for(server.url).complete(CHAT)  # one bad request: skipped, the run goes on
    assert done.finish_reason == "error" and "prompt too long" in done.error


def test_run_bounds_concurrency_and_feeds_follow_ups(server):
    server.delay = 0.05
    engine = engine_for(server.url, concurrency=3)
    pending = [Request(messages=[{"role": "user", "content": f"q{i}"}], tag=i) for i in range(10)]
    results = {}

    def on_complete(req, done):
        results[req.tag] = done.text
        if isinstance(req.tag, int) and req.tag < 2:  # a second turn, fed back while running
            pending.append(Request(messages=[{"role": "user", "content": f"again{req.tag}"}], tag=f"f{req.tag}"))

    engine.run(lambda: pending.pop(0) if pending else None, on_complete)
    assert len(results) == 12 and results["f1"] == "echo: again1"
    assert server.max_inflight == 3


def test_run_stops_on_a_fatal_error(server):
    server.script = lambda path, body, n: (401, b"unauthorized")
    pending = [Request(messages=[{"role": "user", "content": "x"}]) for _ in range(5)]
    with pytest.raises(HttpEngineError, match="401"):
        engine_for(server.url, concurrency=2).run(lambda: pending.pop() if pending else None, lambda r, c: None)


def test_base_url_normalisation():
    assert normalize_base_url("http://h:8000") == "http://h:8000/v1"
    assert normalize_base_url("http://h:8000/v1/") == "http://h:8000/v1"
    assert normalize_base_url("https://h/openai/v1") == "https://h/openai/v1"
    with pytest.raises(ValueError):
        normalize_base_url("localhost:8000")


def test_cli_reports_an_unreachable_server_in_one_line(tmp_path, capsys):
    from dflash_train.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi", "response": "x"}) + "\n")
    rc = main(["generate", "--engine", "http", "--base-url", f"http://127.0.0.1:{port}", "--prompts", str(prompts),
               "--output", str(tmp_path / "o.jsonl"), "--retries", "1", "--retry-backoff-s", "0.01", "--progress", "false"])
    err = capsys.readouterr().err
    assert rc == 2 and f"127.0.0.1:{port}/v1/models after 2 attempts" in err and "Traceback" not in err
    # nothing was written: no resume is promised, and no empty output is left behind
    assert f"no row was written to {tmp_path / 'o.jsonl'} (nothing to resume)" in err
    assert "finished rows are saved" not in err and not (tmp_path / "o.jsonl").exists()


def test_generate_over_http_end_to_end(server, tmp_path):
    from dflash_train.generate.config import GenerateConfig
    from dflash_train.generate.job import run_generate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}", "response": "old"}) + "\n" for i in range(5)))
    server.script = lambda path, body, n: (400, b"too long") if body["messages"][-1]["content"] == "q3" else ok_answer(path, body)
    cfg = GenerateConfig(output=str(tmp_path / "o.jsonl"), prompts=[str(prompts)], engine="http", base_url=server.url,
                         progress=False, concurrency=2)  # fmt: skip
    summary = run_generate(cfg)
    rows = [json.loads(line) for line in open(cfg.output)]
    assert summary["written"] == 4 and summary["skipped_errors"] == 1
    assert {r["messages"][1]["content"] for r in rows} == {"echo: q0", "echo: q1", "echo: q2", "echo: q4"}
    assert rows[0]["generator"]["model"] == "served-model" and rows[0]["generator"]["engine"] == "http"
