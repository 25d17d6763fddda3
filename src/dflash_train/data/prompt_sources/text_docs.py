"""Reading-and-writing requests about real prose that ships with Python and its packages.

* `python-docs` (PSF licence): the language reference topics behind `help("TOPIC")`
  (`pydoc_data.topics`), the docstrings of the built-in functions and types, the module
  docstrings of the standard library, and the Zen of Python (`this`, parsed, not imported: it
  prints on import).
* `package-docs`: the long descriptions (READMEs) in the metadata of installed distributions
  with a permissive licence (`licences.py`).

Documents are cut into passages of `MIN_CHARS`..`MAX_CHARS` at paragraph breaks; passages that
are mostly markup, tables, links or code are dropped. Each passage gets one request, its style
drawn by a generator seeded with (seed, document, passage). All passages of one document form
one group, so the held-out split never cuts a document in two.
"""

from __future__ import annotations

import ast
import builtins
import codecs
import importlib.util
import inspect
import random
import re
from collections.abc import Iterator
from pathlib import Path

from dflash_train.data.prompt_sources.items import PromptItem
from dflash_train.data.prompt_sources.licences import permissive_distributions
from dflash_train.data.prompt_sources.python_code import iter_py_files

MIN_CHARS, MAX_CHARS = 200, 1500
STYLES = {
    "summarize": "Summarize the following text in a few sentences:\n\n{text}",
    "explain": "Explain the following to a beginner, in plain words:\n\n{text}",
    "questions": "Write three questions a reader could ask about this text, and answer each one:\n\n{text}",
    "key-points": "List the key points of this text as bullet points:\n\n{text}",
    "rewrite": "Rewrite this text so that it is shorter and clearer:\n\n{text}",
}
CODE_STYLES = {  # for Python documentation: also ask for code
    "example": "Write a short Python example that illustrates this part of the Python documentation, "
               "and explain it:\n\n{text}",
}
_MARKUP = re.compile(r"(https?://|\[!\[|<img|\|\s*---|^\s*[=\-~^*#]{4,}\s*$|\.\. \w+::)", re.MULTILINE)


def passages(text: str) -> list[str]:
    """Paragraphs of `text` merged into passages of at most MAX_CHARS (longer paragraphs are cut
    at line breaks); paragraphs that are mostly non-prose and passages under MIN_CHARS left out."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", text.replace("\r\n", "\n")) if p.strip()]
    pieces = []
    for para in paras:
        while len(para) > MAX_CHARS:
            cut = para.rfind("\n", 0, MAX_CHARS)
            cut = cut if cut > MIN_CHARS else MAX_CHARS
            pieces.append(para[:cut].strip())
            para = para[cut:].strip()
        pieces.append(para)
    pieces = [p for p in pieces if _prose(p)]  # before merging: one link list must not sink its neighbours
    out, current = [], ""
    for piece in pieces:
        if current and len(current) + len(piece) + 2 > MAX_CHARS:
            out.append(current)
            current = ""
        current = f"{current}\n\n{piece}" if current else piece
    if current:
        out.append(current)
    return [p for p in out if len(p) >= MIN_CHARS]


def _prose(text: str) -> bool:
    letters = sum(c.isalpha() for c in text)
    return letters >= 0.6 * len(text.replace(" ", "")) and len(_MARKUP.findall(text)) <= 2


def document_prompts(docs: Iterator[tuple[str, str]], *, source: str, seed: int, code_styles: bool,
                     per_passage: int = 1) -> list[PromptItem]:
    """`per_passage` requests (distinct styles) per passage of every (document name, text)."""
    styles = {**STYLES, **(CODE_STYLES if code_styles else {})}
    items = []
    for doc, text in docs:
        for k, passage in enumerate(passages(text)):
            names = sorted(styles)
            random.Random(f"{seed}:{doc}:{k}").shuffle(names)
            items.extend(PromptItem(source, style, doc, styles[style].format(text=passage))
                         for style in names[:per_passage])
    return items


def zen_of_python() -> str:
    """`this.s` decoded (ROT13), read from the module's source: importing `this` prints it."""
    spec = importlib.util.find_spec("this")
    if spec is None or not spec.origin:
        return ""
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "s" for t in node.targets):
            return codecs.decode(ast.literal_eval(node.value), "rot13")
    return ""


def python_docs(stdlib: Path) -> Iterator[tuple[str, str]]:
    """(document, text) of the Python documentation that ships with the interpreter."""
    try:
        from pydoc_data.topics import topics  # noqa: PLC0415 - not a project import; absent from some builds
    except ImportError:
        topics = {}
    for name in sorted(topics):
        yield f"topic:{name}", topics[name]
    for name in sorted(dir(builtins)):
        obj = getattr(builtins, name)
        doc = inspect.getdoc(obj) if not name.startswith("_") and callable(obj) else None
        if doc and not (isinstance(obj, type) and issubclass(obj, BaseException)):
            yield f"builtin:{name}", f"Python's built-in `{name}`:\n\n{doc}"
    zen = zen_of_python()
    if zen:
        yield "zen", zen
    for path in iter_py_files(stdlib):
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc:
            module = ".".join(path.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__")
            yield f"module:{module}", f"From the documentation of Python's `{module}` module:\n\n{doc}"


def package_descriptions(licences: dict[str, str]) -> Iterator[tuple[str, str]]:
    """(distribution, long description) of installed distributions with a permissive licence;
    `licences` gets name -> licence of each distribution read."""
    for name, dist, licence in permissive_distributions():
        licences[name] = licence
        text = dist.metadata.get("Description") or dist.metadata.get_payload() or ""
        if isinstance(text, str) and text.strip():
            yield f"pkg:{name}", text
