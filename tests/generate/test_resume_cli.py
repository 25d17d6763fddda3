"""`dflash-train generate` end to end: killed with SIGKILL mid-run, resumed and stopped by SIGTERM,
then resumed to the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dflash_train.generate.config import GenerateConfig
from dflash_train.generate.job import run_generate

QUESTIONS = ["Name three fruits.", "What is gravity?", "How do I sort a list?", "Write a poem about the sea.",
             "What is the capital of France?", "Explain the wind."]  # fmt: skip
N_ROWS = 36


def prompt_rows() -> list[dict]:
    rows = []
    for i in range(N_ROWS):
        q = QUESTIONS[i % len(QUESTIONS)] + " " * (i // len(QUESTIONS))  # distinct rows, varied lengths
        if i % 4 == 3:  # some multi-turn rows
            rows.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "old"},
                                      {"role": "user", "content": "And why?"}, {"role": "assistant", "content": "old"}]})
        else:
            rows.append({"prompt": q, "response": "old answer"})
    return rows


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def wait_for_lines(proc: subprocess.Popen, out: Path, n: int) -> None:
    deadline = time.monotonic() + 120
    while len(lines(out)) < n:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        assert time.monotonic() < deadline, "the run wrote nothing in time"
        time.sleep(0.01)


def test_sigkill_then_sigterm_then_resume_equals_an_uninterrupted_run(tmp_path, model_dir):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in prompt_rows()))
    args = {"target": str(model_dir), "prompts": [str(prompts)], "max_new_tokens": 40, "batch_size": 2,
            "max_prompt_tokens": 320, "device": "cpu", "flush_rows": 1, "progress": False}  # fmt: skip

    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "dflash_train", "generate", "--output", str(out), "--prompts", str(prompts),
           "--summary", "json"]
    for key in ("target", "max_new_tokens", "batch_size", "max_prompt_tokens", "device", "flush_rows", "progress"):
        cmd += [f"--{key.replace('_', '-')}", str(args[key])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_lines(proc, out, 5)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = len(lines(out))
    assert 5 <= killed_at < N_ROWS, "the kill must land mid-run"
    with out.open("ab") as fh:  # what a write cut short by the kill would leave behind
        fh.write(b'{"id": "r-torn", "messages": [{"role": "us')

    # SIGTERM: no new prompt, the conversations started are finished and written, the summary, exit 0
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    wait_for_lines(proc, out, killed_at + 3)
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr.decode()[-3000:]
    stopped = json.loads(stdout)
    assert stopped["stopped_by"] == "SIGTERM" and stopped["already_done"] == killed_at, stopped
    assert "torn last line" in stderr.decode() and "stopped early (SIGTERM)" in stderr.decode()
    stopped_at = len(lines(out))
    assert stopped_at == killed_at + stopped["written"] < N_ROWS, "the stop must land mid-run"

    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads(resumed.stdout)
    assert summary["already_done"] == stopped_at and summary["written"] == N_ROWS - stopped_at, summary
    assert summary["skipped_errors"] == 0 and summary["stopped_by"] is None

    rows = [json.loads(line) for line in lines(out)]  # every line parses: nothing torn remains
    ids = [r["id"] for r in rows]
    assert len(ids) == N_ROWS and len(set(ids)) == N_ROWS

    reference = tmp_path / "reference.jsonl"
    run_generate(GenerateConfig(output=str(reference), **args))
    expected = {r["id"]: r["messages"] for r in map(json.loads, lines(reference))}
    assert {r["id"]: r["messages"] for r in rows} == expected
    assert all(r["generator"]["engine"] == "builtin" and r["generator"]["temperature"] == 0.0 for r in rows)

    # the output is ready for `prepare`
    from dflash_train.data.prepare import PrepareConfig, prepare

    manifest = prepare(PrepareConfig(target=str(model_dir), inputs=[str(out)], output=str(tmp_path / "ds"),
                                     workers=1, progress=False))  # fmt: skip
    assert manifest["counts"]["rows_kept"] == N_ROWS
