"""prepare with worker processes, stopped by a signal to its whole process group (Ctrl-C in a
terminal, `timeout`, a scheduler): it ends within seconds, one line, nothing left behind."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import WORDS


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree from /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_process_group_stops_prepare_and_its_workers(tiny_targets, tmp_path, sig):
    rng = random.Random(0)
    src = tmp_path / "rows.jsonl"
    with src.open("w") as fh:  # enough rows that the workers are busy when the signal comes
        for _ in range(6000):
            fh.write(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=300)),
                                 "response": " ".join(rng.choices(WORDS, k=300))}) + "\n")
    cmd = [sys.executable, "-m", "dflash_train", "prepare", str(src), "-o", str(tmp_path / "out"),
           "--target", str(tiny_targets["llama"]), "--workers", "2", "--no-progress"]
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(_children(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) >= 2, "the workers never started"
        time.sleep(0.5)  # they hold chunks now
        assert proc.poll() is None, "prepare ended before the signal: give it more rows"
        os.killpg(proc.pid, sig)
        rc = proc.wait(timeout=30)  # a hang fails here
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 130, err
    assert err.strip().splitlines()[-1] == "dflash-train prepare: interrupted" and "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["rows.jsonl"]  # no output, no temp folder
    deadline = time.monotonic() + 10
    while any(map(_alive, workers)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(map(_alive, workers)), "a worker outlived prepare"
