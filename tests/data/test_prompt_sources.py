"""`dflash-train prompts`: prompt sources, the HumanEval guard, cross-source de-duplication and
the held-out split, on tiny fixtures (the real sources take minutes; the recipe runs them)."""

from __future__ import annotations

import ast
import gzip
import itertools
import json
import random
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from dflash_train.cli import main
from dflash_train.data.prompt_sources import build as build_mod
from dflash_train.data.prompt_sources.build import HumanEvalLeak, _near, build, check_files
from dflash_train.data.prompt_sources.config import PromptsConfig
from dflash_train.data.prompt_sources.guard import HumanEvalGuard
from dflash_train.data.prompt_sources.items import PromptItem
from dflash_train.data.prompt_sources.licences import expression_ok
from dflash_train.data.prompt_sources.math_problems import TEMPLATES, math_prompts
from dflash_train.data.prompt_sources.python_code import _WRITE, code_prompts, first_sentence
from dflash_train.data.prompt_sources.text_docs import MAX_CHARS, MIN_CHARS, passages
from dflash_train.utils.errors import DataError, InputError, OutputError

CLAMP = '''\
def clamp(value, low, high):
    """Limit a number to the closed range from low to high.

    More text that is not the first paragraph.
    """
    if value < low:
        return low
    return min(value, high)
'''
GREET = '''\
class Greeter:
    def greet(self, name: str) -> str:
        """Return a friendly greeting for the given name."""
        text = "Hello, " + name
        return text + "!"
'''


@pytest.fixture(scope="module")
def humaneval_rows(humaneval_file) -> list[dict]:
    with gzip.open(humaneval_file, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


@pytest.fixture(scope="module")
def guard(humaneval_file) -> HumanEvalGuard:
    return HumanEvalGuard.humaneval(humaneval_file)


def _tree(root: Path, extra: dict[str, str] | None = None) -> Path:
    """A fake standard library: one real module, and files the walker must skip."""
    files = {"pkg/__init__.py": "", "pkg/shapes.py": CLAMP + "\n\n" + GREET,
             "pkg/tests/test_shapes.py": CLAMP, "test_mod.py": CLAMP.replace("clamp", "clamp2"),
             "short.py": 'def tiny(x):\n    """Too short to ask about, this one."""\n    return x\n',
             "private.py": CLAMP.replace("def clamp", "def _clamp") + "\n\nclass _Hidden:\n" + textwrap.indent(GREET, "    ")}
    files.update(extra or {})
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


# -- stdlib-code ----------------------------------------------------------------------------------


def test_code_prompts_exact_on_a_fixture_tree(tmp_path):
    root = _tree(tmp_path)
    items = code_prompts([("stdlib", root)], source="stdlib-code", seed=3, styles_per_function=7)
    by = {(p.group, p.style): p.text for p in items}
    # only the two public documented functions of pkg/shapes.py; tests, short and private ones are skipped
    assert {g for g, _ in by} == {"stdlib:pkg.shapes.clamp", "stdlib:pkg.shapes.Greeter.greet"}
    clamp_body = "def clamp(value, low, high):\n    if value < low:\n        return low\n    return min(value, high)"
    assert by["stdlib:pkg.shapes.clamp", "explain"] == (
        "Explain what this Python code does, step by step:\n\n```python\n" + clamp_body + "\n```")
    assert by["stdlib:pkg.shapes.clamp", "docstring"] == (
        "Write a docstring for this Python function:\n\n```python\n" + clamp_body + "\n```")
    assert by["stdlib:pkg.shapes.clamp", "complete"] == (
        "Complete this Python function:\n\n```python\n" + CLAMP[:CLAMP.index("    if")].rstrip() + "\n```")
    assert by["stdlib:pkg.shapes.clamp", "tests"].endswith("```python\n" + CLAMP.rstrip() + "\n```")
    assert by["stdlib:pkg.shapes.clamp", "type-hints"].endswith("```python\n" + CLAMP.rstrip() + "\n```")
    assert ("stdlib:pkg.shapes.Greeter.greet", "type-hints") not in by  # already annotated
    # the write request: one of the phrasings, the signature and the docstring's first sentence
    sentence = "Limit a number to the closed range from low to high."
    assert by["stdlib:pkg.shapes.clamp", "write"] in {
        t.format(sig="clamp(value, low, high)", where="", sentence=sentence) for t in _WRITE}
    assert "`greet(self, name: str)` (a method of class `Greeter`)" in by["stdlib:pkg.shapes.Greeter.greet", "write"]
    # find-bug: the same code with exactly one operator swapped, docstring dropped
    buggy = re.search(r"```python\n(.*)\n```", by["stdlib:pkg.shapes.clamp", "find-bug"], re.S).group(1)
    original = ast.parse(clamp_body)
    diffs = [(type(a).__name__, type(b).__name__) for a, b in zip(ast.walk(original), ast.walk(ast.parse(buggy)))
             if type(a) is not type(b)]
    assert diffs == [("Lt", "LtE")]
    # deterministic for a seed; fewer styles per function are a subset
    again = code_prompts([("stdlib", root)], source="stdlib-code", seed=3, styles_per_function=7)
    assert [p.text for p in again] == [p.text for p in items]
    two = code_prompts([("stdlib", root)], source="stdlib-code", seed=3, styles_per_function=2)
    assert len(two) == 4 and {(p.group, p.style) for p in two} <= set(by)


def test_parsing_in_worker_processes_gives_the_same_prompts_in_the_same_order(tmp_path):
    """Two roots, many files: the files are parsed by 2 processes (forked) and regrouped by root."""
    extra = {f"pkg/m{i:02d}.py": CLAMP.replace("clamp", f"clamp_{i}") + "\n\n" + GREET.replace("Greeter", f"G{i}")
             for i in range(12)}
    roots = [("one", _tree(tmp_path / "a", extra)), ("two", _tree(tmp_path / "b", extra))]
    serial = code_prompts(roots, source="package-code", seed=5, styles_per_function=3, max_functions_per_root=9)
    parallel = code_prompts(roots, source="package-code", seed=5, styles_per_function=3, max_functions_per_root=9,
                            workers=2)
    assert len(serial) == 2 * 9 * 3
    assert [(p.group, p.style, p.text) for p in parallel] == [(p.group, p.style, p.text) for p in serial]
    assert [p.group.split(":")[0] for p in serial] == ["one"] * 27 + ["two"] * 27


def test_first_sentence():
    assert first_sentence("return the value of the thing.\n\nMore.") == "Return the value of the thing."
    assert first_sentence("Compute a value without a period at the end") == "Compute a value without a period at the end."
    assert first_sentence("Short.") is None
    assert first_sentence("See the other function for details on this.") is None


# -- math, text ------------------------------------------------------------------------------------


def test_math_problems_are_seeded_per_index_and_well_posed():
    a, b = math_prompts(60, seed=5), math_prompts(20, seed=5)
    assert [p.text for p in a[:20]] == [p.text for p in b]
    assert [p.text for p in math_prompts(20, seed=6)] != [p.text for p in b]
    assert {p.style for p in a} == set(TEMPLATES)  # an even mix: every template within 18 problems
    for p in math_prompts(200, seed=1):
        m = re.match(r"Solve for (\w): (\d+)\1 ([+-]) (\d+) = (-?\d+)\.", p.text)
        if m:  # the equations have integer solutions, as built
            a_, sign, b_, c = int(m[2]), m[3], int(m[4]), int(m[5])
            assert (c - (b_ if sign == "+" else -b_)) % a_ == 0


def test_passages_merge_paragraphs_and_drop_markup():
    prose = "This paragraph explains how the feature works in simple words for readers. " * 3
    text = "\n\n".join([prose] * 5 + ["[![badge](https://x)](https://y) https://a https://b"] + ["tiny"])
    out = passages(text)
    assert all(MIN_CHARS <= len(p) <= MAX_CHARS for p in out)
    assert sum(p.count("This paragraph") for p in out) == 15  # every prose paragraph, once
    assert not any("https" in p for p in out)
    assert passages("tiny\n\nalso small") == []


def test_licence_expressions():
    assert expression_ok("MIT") and expression_ok("BSD-3-Clause") and expression_ok("Apache 2.0 License")
    assert expression_ok("Apache-2.0 OR GPL-2.0-only")  # one permissive alternative is enough
    assert not expression_ok("GPL-3.0") and not expression_ok("MPL-2.0 AND MIT") and not expression_ok("")
    assert not expression_ok("Permission is hereby granted, free of charge, to any person obtaining a copy of " * 2)


# -- the HumanEval guard -----------------------------------------------------------------------------


def test_guard_catches_planted_and_paraphrased_humaneval(guard, humaneval_rows):
    prompt = humaneval_rows[0]["prompt"]  # has_close_elements
    paraphrase = (prompt.replace("has_close_elements", "any_two_near").replace("Check if", "Determine whether")
                  .replace("given threshold", "threshold given").replace("numbers", "values"))
    texts = [
        "Explain what the zip built-in does, with an example.",
        "Complete the following code:\n\n```python\n" + prompt + "```",  # wrapped
        paraphrase,  # renamed and reworded
        "Explain this code:\n" + humaneval_rows[12]["prompt"] + humaneval_rows[12]["canonical_solution"],
        CLAMP,
    ]
    found = guard.matches(texts)
    assert [m.candidate for m in found] == [1, 2, 3]
    assert found[0].reference == "HumanEval/0 prompt" and found[0].overlap == 1.0
    assert found[1].reference == "HumanEval/0 prompt" and 0.5 <= found[1].overlap < 1.0
    assert found[2].reference.startswith("HumanEval/12")


def test_guard_is_exact_against_a_brute_force_overlap(humaneval_rows):
    """On small references (no boilerplate n-gram is in >5% and >= 3 of them) the overlap
    coefficient must equal a set computation over word 3-grams."""
    refs = [(f"r{i}", humaneval_rows[i]["prompt"]) for i in (1, 2)]
    g = HumanEvalGuard(refs, threshold=0.3)
    words = lambda t: re.findall(r"\w+", t.lower())  # noqa: E731
    grams = lambda t: {tuple(w[i:i + 3]) for w in [words(t)] for i in range(len(w) - 2)}  # noqa: E731
    rng = random.Random(0)
    texts = []
    for _ in range(40):
        w = words(refs[rng.randrange(2)][1])
        a = rng.randrange(len(w) // 2)
        texts.append(" ".join(w[a:a + rng.randrange(5, 60)] + rng.sample(w, rng.randrange(0, 30))))
    expected = {}
    for i, t in enumerate(texts):
        for name, r in refs:
            c, s = grams(t), grams(r)
            shared = len(c & s)
            if c and shared >= 8 and shared / min(len(c), len(s)) >= 0.3:
                expected[i] = max(expected.get(i, 0), shared / min(len(c), len(s)))
    found = {m.candidate: m.overlap for m in g.matches(texts)}
    assert set(found) == set(expected) and len(found) > 5
    assert all(abs(found[i] - round(expected[i], 3)) < 1e-9 for i in found)


def test_build_fails_loudly_on_a_humaneval_function_in_a_source(tmp_path, guard, humaneval_rows):
    row = humaneval_rows[0]
    root = _tree(tmp_path / "lib", {"leak.py": row["prompt"] + row["canonical_solution"]})
    cfg = PromptsConfig(output=str(tmp_path / "out"), sources=["stdlib-code"], stdlib=str(root))
    with pytest.raises(HumanEvalLeak, match=r"source stdlib-code:.*stdlib:leak.has_close_elements.*HumanEval/0"):
        build(cfg, guard)
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_source_that_finds_no_prompt_is_an_error_not_an_empty_set(tmp_path, guard):
    root = tmp_path / "lib"
    root.mkdir()
    (root / "README.txt").write_text("no Python here")
    cfg = PromptsConfig(output=str(tmp_path / "out"), sources=["math", "stdlib-code"], stdlib=str(root))
    with pytest.raises(InputError) as exc:
        build(cfg, guard)
    assert str(exc.value) == (f"--sources stdlib-code: no prompt found in the standard library at {root} (--stdlib); "
                              f"give it something to read, or leave it out of --sources")
    assert not (tmp_path / "out").exists()  # nothing written


def test_check_files_names_file_line_and_field(tmp_path, guard, humaneval_rows):
    good = {"messages": [{"role": "user", "content": "Sort a list in Python."}, {"role": "assistant", "content": "x"}]}
    leak = {"prompt": "Please solve:\n" + humaneval_rows[3]["prompt"], "response": ""}
    path = tmp_path / "gen.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, good, leak)) + "\n")
    with pytest.raises(HumanEvalLeak, match=re.escape(f"{path}:3 field 'messages[0].content'") + ".*HumanEval/3"):
        check_files([str(path)], guard)
    path.write_text(json.dumps(good) + "\n" + json.dumps({"messages": [{"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:2: field 'messages[0].role'")):
        check_files([str(path)], guard)
    assert main(["prompts", "--check", str(tmp_path / "missing.jsonl")]) == 2


def test_bad_humaneval_file_names_the_line(tmp_path):
    bad = tmp_path / "he.jsonl"
    bad.write_text(json.dumps({"task_id": "x", "prompt": "p", "canonical_solution": "s"}) + "\n{\"task_id\": 1}\n")
    with pytest.raises(DataError, match=re.escape(f"{bad}:2")):
        HumanEvalGuard.humaneval(bad)


# -- de-duplication and the held-out split ------------------------------------------------------------


def _sentence(rng: random.Random, n: int) -> list[str]:
    return [f"w{rng.randrange(5000)}" for _ in range(n)]


def test_cross_source_near_duplicates_match_a_brute_force_jaccard():
    rng = random.Random(1)
    corpus_words = [_sentence(rng, 40) for _ in range(8)]  # < 10 items: no boilerplate is ignored
    queries = []
    for i in range(60):
        base = list(corpus_words[i % 8]) if i % 3 else _sentence(rng, 40)
        for _ in range(rng.choice((0, 1, 2, 8, 14))):  # a few edits (J >> 0.5) or many (J << 0.5)
            base[rng.randrange(len(base))] = f"x{rng.randrange(10**6)}"
        queries.append(base)
    item = lambda ws: PromptItem("s", "t", " ".join(ws), " ".join(ws))  # noqa: E731
    got = _near([item(q) for q in queries], [item(c) for c in corpus_words], 0.5, seed=0)
    grams = lambda ws: {tuple(ws[i:i + 3]) for i in range(len(ws) - 2)}  # noqa: E731
    want = np.array([any(len(grams(q) & grams(c)) / len(grams(q) | grams(c)) >= 0.5 for c in corpus_words)
                     for q in queries])
    assert want.sum() >= 10 and (~want).sum() >= 10
    assert np.array_equal(got, want)


def _fake_sources(monkeypatch, per_source: dict[str, list[PromptItem]]):
    def collect(cfg, name, report):
        report.provenance["fixture"] = "test"
        return list(per_source[name])
    monkeypatch.setattr(build_mod, "collect", collect)


def _items(source: str, n: int, groups: int, rng: random.Random) -> list[PromptItem]:
    return [PromptItem(source, "t", f"g{i % groups}", " ".join(_sentence(rng, 30))) for i in range(n)]


def test_build_dedups_splits_by_group_shards_and_is_deterministic(tmp_path, monkeypatch, guard):
    rng = random.Random(2)
    a = _items("stdlib-code", 300, 60, rng)
    b = _items("math", 200, 200, rng)
    b[5] = PromptItem("math", "t", "dup-exact", "  " + a[7].text.upper() + " ")  # exact (case/space) duplicate
    words = a[9].text.split()
    b[6] = PromptItem("math", "t", "dup-near", " ".join(words[:-1] + ["changed"]))  # near duplicate
    _fake_sources(monkeypatch, {"stdlib-code": a, "math": b})
    cfg = PromptsConfig(output=str(tmp_path / "p"), sources=["stdlib-code", "math"], heldout=20, heldout_fraction=0.2,
                        shards=2, seed=4)
    manifest, written = build(cfg, guard)
    assert written
    s = manifest["sources"]
    assert s["math"]["exact_duplicates"] == 1 and s["math"]["near_duplicates"] == 1
    assert s["stdlib-code"]["exact_duplicates"] == 0 and s["stdlib-code"]["near_duplicates"] == 0

    def rows(rel):
        return [json.loads(line) for line in (tmp_path / "p" / rel).read_text().splitlines()]

    for name, total in (("stdlib-code", 300), ("math", 198)):
        train = rows(f"train/{name}-0of2.jsonl") + rows(f"train/{name}-1of2.jsonl")
        held = rows(f"heldout/{name}-heldout.jsonl")
        assert abs(len(rows(f"train/{name}-0of2.jsonl")) - len(rows(f"train/{name}-1of2.jsonl"))) <= 1
        assert len(train) + len(held) + s[name]["heldout_dropped"] == total
        assert 20 <= len(held) + s[name]["heldout_dropped"] < 20 + (5 if name == "stdlib-code" else 1)
        assert not {r["group"] for r in train} & {r["group"] for r in held}  # disjoint by group ...
        train_text = {r["messages"][0]["content"] for r in train}
        assert not train_text & {r["messages"][0]["content"] for r in held}  # ... and so by prompt
        assert all(r["messages"][1] == {"role": "assistant", "content": ""} for r in train + held)
    # same options: kept; a rebuild elsewhere is byte-identical
    assert build(cfg, guard) == (manifest, False)
    other = PromptsConfig(**{**cfg.__dict__, "output": str(tmp_path / "q")})
    build(other, guard)
    for rel in manifest["sources"]["math"]["files"]:
        assert (tmp_path / "p" / rel).read_bytes() == (tmp_path / "q" / rel).read_bytes()
    with pytest.raises(OutputError, match="other options"):
        build(PromptsConfig(**{**cfg.__dict__, "seed": 5}), guard)


def test_heldout_drops_near_duplicates_of_training_prompts(tmp_path, monkeypatch, guard):
    rng = random.Random(3)
    a = _items("math", 100, 100, rng)
    # every prompt has a twin one word apart in another group: whichever twin is held out is dropped
    twins = [PromptItem("math", "t", p.group + "-twin", p.text.rsplit(" ", 1)[0] + " other") for p in a]
    _fake_sources(monkeypatch, {"math": list(itertools.chain(a, twins))})
    cfg = PromptsConfig(output=str(tmp_path / "p"), sources=["math"], heldout=10, heldout_fraction=0.5)
    manifest, _ = build(cfg, guard)
    m = manifest["sources"]["math"]
    assert m["heldout_groups"] == 10 and m["heldout"] + m["heldout_dropped"] == 10
    assert m["heldout_dropped"] >= 8  # a twin pair can be held out together (both kept); rarely


def test_cli_rejects_an_unknown_source(tmp_path, capsys):
    assert main(["prompts", "--output", str(tmp_path / "x"), "--sources", "stdlib-code", "wiki"]) == 2
    assert "unknown prompt source" in capsys.readouterr().err


def test_word_ids_are_the_crc32_of_each_lower_cased_word_stable_across_processes():
    import zlib

    from dflash_train.data.prompt_sources.items import word_ids

    ids = word_ids("Hello, World!  hello_2 héllo")
    assert ids.dtype == np.uint64
    assert ids.tolist() == [zlib.crc32(w.encode()) for w in ("hello", "world", "hello_2", "héllo")]
    assert ids.tolist() == [0x3610A686, 0x3A771143, zlib.crc32(b"hello_2"), zlib.crc32("héllo".encode())]
    assert word_ids("  ,. ").shape == (0,)
