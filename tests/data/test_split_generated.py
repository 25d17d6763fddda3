"""scripts/split_generated.py: the recipe's train / held-out split of generated rows and its data
mix (--weights), run as the recipe runs it (a subprocess), against counts worked out here."""

import hashlib
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "split_generated.py"


def row(i: int, file: str | None) -> dict:
    r = {"id": f"r-{i:05d}", "messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
    if file is not None:
        r["source"] = {"file": file, "line": i}
    return r


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(tmp: Path, *inputs: Path, weights: str = "") -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), str(tmp / "train.jsonl"), str(tmp / "heldout.jsonl"), *map(str, inputs)]
    if weights:
        cmd += ["--weights", weights]
    return subprocess.run(cmd, capture_output=True, text=True)


def ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def kept_by_half(rows: list[dict]) -> set[str]:
    """Brute force of the documented rule for weight 0.5: sha256(id)'s first 8 bytes / 2**64 < 0.5."""
    return {r["id"] for r in rows if int.from_bytes(hashlib.sha256(r["id"].encode()).digest()[:8], "big") < 2 ** 63}


@pytest.fixture
def gen(tmp_path: Path) -> tuple[Path, Path, list[dict]]:
    rows0 = ([row(i, "package-code-0of2.jsonl") for i in range(0, 200)] + [row(i, None) for i in range(200, 260)]
             + [row(i, "math-heldout.jsonl") for i in range(260, 270)])
    rows1 = [row(i, "/w/prompts/train/math-1of2.jsonl") for i in range(270, 370)]
    return write(tmp_path / "gen-0.jsonl", rows0), write(tmp_path / "gen-1.jsonl", rows1), rows0 + rows1


def test_split_without_weights_keeps_every_row_once(tmp_path: Path, gen) -> None:
    g0, g1, rows = gen
    with open(g1, "a") as fh:
        fh.write('{"id": "torn')  # the torn tail of a killed generate
    done = run(tmp_path, g0, g1)
    assert done.returncode == 0, done.stderr
    assert "unreadable line" in done.stderr
    assert ids(tmp_path / "heldout.jsonl") == [f"r-{i:05d}" for i in range(260, 270)]
    assert ids(tmp_path / "train.jsonl") == [r["id"] for r in rows if int(r["id"][2:]) not in range(260, 270)]


def test_weights_drop_halve_and_repeat_by_source(tmp_path: Path, gen) -> None:
    g0, g1, rows = gen
    done = run(tmp_path, g0, g1, weights="package-code=0.5, self-instruct=3,math=0")
    assert done.returncode == 0, done.stderr
    train = Counter(ids(tmp_path / "train.jsonl"))
    package = [r for r in rows if int(r["id"][2:]) < 200]
    expected = Counter({i: 1 for i in kept_by_half(package)})
    expected.update({f"r-{i:05d}": 3 for i in range(200, 260)})
    assert train == expected
    assert 70 < len(kept_by_half(package)) < 130  # the hash splits, not a degenerate rule
    assert len(ids(tmp_path / "heldout.jsonl")) == 10  # held-out rows are never weighted (math=0 keeps them)
    assert "package-code        200 read" in done.stdout


def test_a_misspelt_source_fails_and_writes_nothing(tmp_path: Path, gen) -> None:
    g0, g1, _ = gen
    done = run(tmp_path, g0, g1, weights="pakage-code=2")
    assert done.returncode != 0
    assert "source(s) pakage-code" in done.stderr
    assert "the sources are: math, package-code, self-instruct" in done.stderr
    assert not (tmp_path / "train.jsonl").exists() and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("bad", ["math", "math=-1", "=2", "math=x"])
def test_a_malformed_weight_is_named(tmp_path: Path, gen, bad: str) -> None:
    g0, _, _ = gen
    done = run(tmp_path, g0, weights=bad)
    assert done.returncode != 0 and repr(bad) in done.stderr
