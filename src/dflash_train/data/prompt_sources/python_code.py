"""Code requests built from documented Python functions: the standard library's own sources
(`stdlib-code`) and those of permissively licensed installed packages (`package-code`).

Files are parsed with `ast`, never imported (importing runs module code; parsing is safe and the
same on every machine with the same files). Every public function or method of a public class
that has a docstring and a body of `MIN_LINES`..`MAX_LINES` lines yields requests in
`styles_per_function` of these styles, picked by a generator seeded with (seed, function), so
adding a file never changes another function's prompts:

* write: "Write a Python function `f(a, b)` ...: <first docstring sentence>"
* complete: the signature and docstring, to be completed
* explain: the code without its docstring, to be explained
* docstring: the code without its docstring, to be documented
* type-hints: code without annotations, to be annotated
* find-bug: the code with one comparison or arithmetic operator swapped, to be fixed
* tests: the code, to be tested with pytest

All prompts of one function form one group: the held-out split keeps them on one side.
"""

from __future__ import annotations

import ast
import random
import re
import sysconfig
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from dflash_train.data.prompt_sources.items import PromptItem, group_hash
from dflash_train.data.prompt_sources.licences import permissive_licence
from dflash_train.utils.parallel import ordered_map

MIN_LINES, MAX_LINES, MAX_CHARS = 4, 60, 3000
MAX_FILE_BYTES = 1 << 20  # generated tables (unicode data, encodings) are not code worth asking about
# parts of a path that mark tests, demos, vendored or generated code: skipped
SKIP_PARTS = frozenset({"test", "tests", "testing", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages",
                        "dist-packages", "pydoc_data", "__pycache__", "_vendor", "vendored", "examples", "benchmarks",
                        "encodings"})
STYLES = ("write", "complete", "explain", "docstring", "type-hints", "find-bug", "tests")
_WRITE = ("Write a Python function `{sig}`{where}. {sentence}",
          "Implement `{sig}`{where} in Python. What it should do: {sentence}",
          "I need a Python function `{sig}`{where}. {sentence} Please write it.")
_SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


@dataclass
class Function:
    group: str  # "<root label>:<module>.<qualname>"
    qualname: str
    source: str  # dedented, decorators left out
    header: str  # the `def` line(s)
    docstring_lines: tuple[int, int]  # 0-based [start, end) of the docstring within `source`
    docstring: str
    signature: str  # `name(args)`, as the source spells the arguments
    annotated: bool
    # (plain strings only: worker processes send these back, and pickling AST nodes costs
    # more than parsing them)


def stdlib_root() -> Path:
    """The standard library of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def skipped(rel: Path) -> bool:
    return any(p in SKIP_PARTS or p.startswith("test_") or p.endswith("_test.py") or p == "conftest.py"
               for p in rel.parts)


def iter_py_files(root: Path) -> Iterator[Path]:
    """`.py` files under `root` in a fixed (sorted) order, tests and vendored code left out."""
    for path in sorted(root.rglob("*.py")):
        if not skipped(path.relative_to(root)) and path.is_file() and path.stat().st_size <= MAX_FILE_BYTES:
            yield path


def first_sentence(doc: str) -> str | None:
    """The docstring's first sentence (one line, trailing period kept), or None if it is unusable
    (too short or long, a bare signature, or a reference like "See foo")."""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", para)
    sentence = match.group(1) if match else para + "."
    if not 20 <= len(sentence) <= 300 or "(" in sentence[:30] and ")" in sentence[:60] and "->" in sentence:
        return None
    if sentence.lower().startswith(("see ", "same as", "deprecated", "alias", "internal", "helper", "todo")):
        return None
    return sentence[0].upper() + sentence[1:]


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield f"{node.name}.{sub.name}", sub


def functions_in(path: Path, root: Path, label: str) -> list[Function]:
    """The usable functions of one file (none when it does not parse: old or templated sources)."""
    try:
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    lines = text.splitlines()
    module = ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
    out = []
    for qualname, node in _functions(tree):
        name = node.name
        doc = ast.get_docstring(node)
        if name.startswith("_") or not doc or node.end_lineno is None:
            continue
        start, end = node.lineno - 1, node.end_lineno  # `def` line .. last line; decorators excluded
        if not MIN_LINES <= end - start <= MAX_LINES:
            continue
        source = textwrap.dedent("\n".join(lines[start:end]))
        if len(source) > MAX_CHARS or "\t" in source:
            continue
        first = node.body[0]
        doc_lines = (first.lineno - 1 - start, first.end_lineno - start)
        header_end = doc_lines[0]
        if header_end < 1 or len(node.body) < 2:  # a docstring on the def line, or nothing but a docstring
            continue
        args = node.args
        all_args = args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]
        annotated = node.returns is not None or any(a.annotation is not None for a in all_args)
        header = "\n".join(source.splitlines()[:header_end])
        fn = Function(f"{label}:{module}.{qualname}", qualname, source, header, doc_lines, doc,
                      f"{node.name}({ast.unparse(node.args)})", annotated)
        try:  # both must stand alone (a string literal at column 0 defeats the dedent)
            ast.parse(source)
            ast.parse(without_docstring(fn))
        except SyntaxError:
            continue
        out.append(fn)
    return out


def without_docstring(fn: Function) -> str:
    lines = fn.source.splitlines()
    return "\n".join(lines[:fn.docstring_lines[0]] + lines[fn.docstring_lines[1]:])


def with_bug(fn: Function, rng: random.Random) -> str | None:
    """The function with one swapped operator (docstring dropped: it would give the answer away),
    or None when it has no operator to swap."""
    tree = ast.parse(without_docstring(fn))
    sites = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sites += [(node.ops, i) for i, op in enumerate(node.ops) if type(op) in _SWAP]
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _SWAP:
            sites.append((node, None))
    if not sites:
        return None
    holder, i = sites[rng.randrange(len(sites))]
    if i is None:
        holder.op = _SWAP[type(holder.op)]()
    else:
        holder[i] = _SWAP[type(holder[i])]()
    return ast.unparse(tree)


def _code(text: str) -> str:
    return f"```python\n{text.rstrip()}\n```"


def prompt(fn: Function, style: str, rng: random.Random) -> str | None:
    """The request of one style for one function, or None when the style does not apply."""
    if style == "write":
        sentence = first_sentence(fn.docstring)
        if sentence is None:
            return None
        where = f" (a method of class `{fn.qualname.split('.')[0]}`)" if "." in fn.qualname else ""
        return rng.choice(_WRITE).format(sig=fn.signature, where=where, sentence=sentence)
    if style == "complete":
        lines = fn.source.splitlines()
        return "Complete this Python function:\n\n" + _code("\n".join(lines[:fn.docstring_lines[1]]))
    if style == "explain":
        return "Explain what this Python code does, step by step:\n\n" + _code(without_docstring(fn))
    if style == "docstring":
        return "Write a docstring for this Python function:\n\n" + _code(without_docstring(fn))
    if style == "type-hints":
        if fn.annotated:
            return None
        return "Add type hints to this Python function and explain your choices:\n\n" + _code(fn.source)
    if style == "find-bug":
        buggy = with_bug(fn, rng)
        if buggy is None:
            return None
        return ("This Python function has a bug: one operator is wrong. Find it, explain it and give the fixed "
                "function:\n\n" + _code(buggy))
    if style == "tests":
        return "Write pytest unit tests for this Python function:\n\n" + _code(fn.source)
    raise ValueError(f"unknown style {style!r}")


def _functions_in_task(task: tuple[Path, Path, str]) -> list[Function]:
    return functions_in(*task)


def parse_files(tasks: list[tuple[Path, Path, str]], workers: int) -> list[list[Function]]:
    """`functions_in(path, root, label)` of every task, in the tasks' order. Parsing is most of
    the job's time (tens of thousands of files on a machine with many packages), so with
    `workers` > 1 the files are parsed in that many processes; the result is the same."""
    return ordered_map(_functions_in_task, tasks, workers)


def code_prompts(roots: list[tuple[str, Path]], *, source: str, seed: int, styles_per_function: int,
                 max_functions_per_root: int = 0, workers: int = 1) -> list[PromptItem]:
    """Prompts of every usable function under each (label, root) directory, in a fixed order.
    With `max_functions_per_root`, a root keeps that many functions, drawn by seeded hash.
    `workers` processes parse the files (`parse_files`)."""
    files = [(i, path) for i, (_, root) in enumerate(roots) for path in iter_py_files(root)]
    parsed = parse_files([(path, roots[i][1], roots[i][0]) for i, path in files], workers)
    per_root: list[list[Function]] = [[] for _ in roots]
    for (i, _), functions in zip(files, parsed):
        per_root[i].extend(functions)
    items = []
    for functions in per_root:
        if max_functions_per_root and len(functions) > max_functions_per_root:
            key = {fn.group: group_hash(f"{seed}", fn.group) for fn in functions}
            functions = sorted(sorted(functions, key=lambda f: key[f.group])[:max_functions_per_root],
                               key=lambda f: f.group)
        for fn in functions:
            rng = random.Random(f"{seed}:{fn.group}")
            styles = list(STYLES)
            rng.shuffle(styles)
            made = 0
            for style in styles:
                text = prompt(fn, style, rng)
                if text is not None:
                    items.append(PromptItem(source, style, fn.group, text))
                    made += 1
                    if made == styles_per_function:
                        break
    return items


def package_roots() -> list[tuple[str, Path, str]]:
    """(distribution name, package directory, licence) of the top-level packages of every installed
    distribution with a permissive licence (`licences.py`), sorted by name; each directory once."""
    seen: set[Path] = set()
    out = []
    for dist in sorted(metadata.distributions(), key=lambda d: (d.metadata.get("Name") or "").lower()):
        licence = permissive_licence(dist)
        if licence is None:
            continue
        name = dist.metadata["Name"]
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if str(f).endswith(".py") and len(Path(str(f)).parts) > 1}
        for top in sorted(tops):
            directory = Path(str(dist.locate_file(top))).resolve()
            if top.endswith((".dist-info", ".egg-info", ".data")) or directory in seen or not directory.is_dir():
                continue
            seen.add(directory)
            out.append((name, directory, licence))
    return out
