"""scripts/split_generated.py: the recipe's train / held-out split of generated rows and its data
mix (--weights), run as the recipe runs it (a subprocess), against counts worked out here."""

import hashlib
import json
import re
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


def run(tmp: Path, *inputs: Path, weights: str = "", exclude: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(SCRIPT), str(tmp / "train.jsonl"), str(tmp / "heldout.jsonl"), *map(str, inputs)]
    if weights:
        cmd += ["--weights", weights]
    for spec in exclude:
        cmd += ["--exclude", spec]
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
    assert done.returncode == 2
    assert "source(s) pakage-code" in done.stderr
    assert "the sources are: math, package-code, self-instruct" in done.stderr
    assert not (tmp_path / "train.jsonl").exists() and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("bad", ["math", "math=-1", "=2", "math=x"])
def test_a_malformed_weight_is_named(tmp_path: Path, gen, bad: str) -> None:
    g0, _, _ = gen
    done = run(tmp_path, g0, weights=bad)
    assert done.returncode == 2 and repr(bad) in done.stderr


def jaccard_3grams(a: str, b: str) -> float:
    """Brute force of the documented rule: lower-cased words, their 3-grams as sets."""
    grams = [{tuple(w[i:i + 3]) for i in range(len(w) - 2)} for w in (re.findall(r"\w+", t.lower()) for t in (a, b))]
    return len(grams[0] & grams[1]) / len(grams[0] | grams[1])


def test_exclude_leaves_out_training_rows_that_near_duplicate_an_eval_prompt(tmp_path: Path) -> None:
    evals = ["Can you explain the benefits of using AI in the healthcare industry today?",
             "Write a short poem about the sea and the wind at night."]
    write(tmp_path / "evals.jsonl", [{"id": f"e{i}", "prompt": p} for i, p in enumerate(evals)])
    turns = {
        "copy": evals[0].upper(),  # case does not hide it
        "near": "Can you explain the benefits of using AI in the healthcare industry?",  # J = 0.91
        "edge": "Please write a short poem about the sea and a wind at night.",  # J = 0.5 exactly: out
        "below": "Write a short poem about the sea in winter",  # J = 0.42: kept
        "far": "Can you explain the benefits of running in the morning for the heart?",  # J = 0.22
        "other": "How do I sort a list of tuples by their second element in Python?",
    }
    rows = [{"id": name, "messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "a"}]}
            for name, text in turns.items()]
    rows.append({"id": "held", "source": {"file": "chat-heldout.jsonl"}, "messages": rows[0]["messages"]})
    gen = write(tmp_path / "gen-0.jsonl", rows)
    done = run(tmp_path, gen, weights="self-instruct=2", exclude=(str(tmp_path / "evals.jsonl"),))
    assert done.returncode == 0, done.stderr
    want_out = {name for name, text in turns.items() if max(jaccard_3grams(text, e) for e in evals) >= 0.5}
    assert want_out == {"copy", "near", "edge"}  # the planted cases sit where they were meant to
    assert Counter(ids(tmp_path / "train.jsonl")) == {name: 2 for name in turns if name not in want_out}
    assert ids(tmp_path / "heldout.jsonl") == ["held"]  # held-out rows are never left out
    assert "left out of" in done.stdout and "3 rows near-duplicating" in done.stdout and "self-instruct 3" in done.stdout


def test_exclude_with_a_missing_prompt_set_fails_before_writing(tmp_path: Path, gen) -> None:
    g0, _, _ = gen
    done = run(tmp_path, g0, exclude=(str(tmp_path / "missing.jsonl"),))
    assert done.returncode == 2 and "--exclude: prompt file not found" in done.stderr
    assert done.stderr.count("\n") == 1  # one line, no traceback
    assert not (tmp_path / "train.jsonl").exists() and not list(tmp_path.glob("*.tmp"))
