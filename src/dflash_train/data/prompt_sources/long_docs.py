"""Long-document tasks (`long-docs`): summarise, extract, or answer a question from a whole
document of `MIN_CHARS`..`MAX_CHARS` (several hundred to ~1,600 tokens), where `python-docs`
and `package-docs` ask about passages of at most 1,500 characters.

Documents, read from the machine, never imported or fetched:

* Python's documentation (PSF licence): the language reference topics behind `help("TOPIC")`
  (`pydoc_data.topics`), and the module, class and public function docstrings of the
  standard library (parsed with `ast`);
* installed distributions with a permissive licence (`licences.py`): their READMEs (metadata
  long descriptions) and the documentation files (`.md`, `.rst`, `.txt`) they install, outside
  their metadata folder, tests and vendored code, licence and author lists left out; and the long
  module, class and public function docstrings of their Python files (API references: argument
  lists, examples), at most `MAX_API_DOCS` of one distribution, drawn by a hash of their names.

Badges, images and HTML lines are removed; a document longer than `MAX_CHARS` is cut at
paragraph breaks (never inside a code fence) into parts of at most `MAX_CHARS`, and at most
`MAX_PARTS` parts of one document are kept (drawn by a generator seeded with (seed, document)).
Each part gets `per_document` requests of distinct styles, drawn with (seed, document, part):

* summarize: a summary of a given shape (a paragraph, bullet points, three sentences);
* extract-list: every function, option, version or date, or term the part mentions (a kind the
  part has);
* extract-json: a JSON object of fields to fill from the part (fields by kind of document);
* extract-steps: the steps or instructions the part gives, in order;
* question: a question about something the part names (a section heading, an identifier, an
  option), to be answered from the part only.

All parts of one document form one group, so the held-out split never cuts a document in two.
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from dflash_train.data.prompt_sources.items import PromptItem, group_hash
from dflash_train.data.prompt_sources.licences import NEVER_READ, permissive_distributions
from dflash_train.data.prompt_sources.python_code import MAX_FILE_BYTES as MAX_PY_BYTES
from dflash_train.data.prompt_sources.python_code import iter_py_files, skipped
from dflash_train.utils.parallel import ordered_map

# a part of a document: 1,500..6,000 characters and at most 1,300 estimated tokens (`estimated_tokens`), so
# that with the request a prompt stays under ~1,800 tokens (the recipe's `generate` skips prompts over 2,048)
MIN_CHARS, MAX_CHARS, MAX_TOKENS = 1500, 6000, 1300
LINE_CHARS = 1000  # a longer line (minified text, a table row) is cut
MAX_PARTS = 4  # parts kept of one long document (a 140K-char changelog must not dominate)
MAX_FILE_BYTES = 200_000
# API docstrings kept of one distribution: a large library (torch, transformers) has thousands, and
# its argument lists must not crowd out the READMEs and guides of the others
MAX_API_DOCS = 300
DOC_SUFFIXES = (".md", ".rst", ".txt")
# installed files that are not documentation: licences, author lists, metadata, build lists
_NOT_DOCS = re.compile(r"^(licen[cs]e|copying|notice|authors|contributors|entry_points|top_level|requirements|"
                       r"sources|dependency_links|cmakelists|vendor|record|installer|namespace_packages)",
                       re.IGNORECASE)
# lines that carry no text: badges, images, raw HTML, reST image/raw directives and their options
_NOISE = re.compile(r"^\s*(\[!\[|!\[|</?(img|p|a|div|h\d|br|picture|source|table|tr|td|span|sub|sup)\b|"
                    r"\.\. (image|figure|raw|\|[^|]+\|)|:(target|alt|width|height|align|scale|class):)",
                    re.IGNORECASE)
_HEADING_MD = re.compile(r"^#{1,4} +(\S.{2,70})$", re.MULTILINE)
_HEADING_RST = re.compile(r"^(\S.{2,70})\n[=\-~^*#+]{3,}$", re.MULTILINE)
_FUNCTION = re.compile(r"(?<![\w.])((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)\(\)")
_OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]+)")
_VERSION_OR_DATE = re.compile(r"\b(?:(?:19|20)\d\d-\d\d-\d\d|v?\d+\.\d+(?:\.\d+)?)\b")
_CODE_NAME = re.compile(r"`{1,2}([A-Za-z_][\w.]{2,40})`{1,2}")


@dataclass(frozen=True)
class Document:
    name: str  # the group: e.g. "topic:if", "pkg:numpy", "file:numpy/numpy/ma/README.rst"
    title: str  # what the prompt calls it, e.g. "the README of the Python package `numpy`"
    kind: str  # "python" or "package": which JSON fields fit
    text: str


# -- reading -----------------------------------------------------------------------------------------


def clean(text: str) -> str:
    """`text` without badge, image and HTML lines, blank-line runs squeezed, trailing spaces cut."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n") if not _NOISE.match(line)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def _blocks(text: str) -> list[str]:
    """Paragraphs, a fenced code block (```) kept whole even when it holds blank lines."""
    out: list[str] = []
    for para in text.split("\n\n"):
        if out and out[-1].count("```") % 2:
            out[-1] += "\n\n" + para
        else:
            out.append(para)
    return out


def estimated_tokens(text: str) -> float:
    """A tokenizer-free estimate of a BPE token count (the target is not known here): a letter
    is ~1/4 token, any other non-space character ~3/4 (digits, punctuation and code split
    finely). Within 0.7-1.35x of SmolLM2's count on this source's prompts; characters alone
    were 2.3-5.6 per token (changelogs, tables)."""
    letters = sum(map(str.isalpha, text))  # a map over str methods: the same counts, several times faster
    return letters / 4 + (len(text) - sum(map(str.isspace, text)) - letters) * 0.75


def _pack(pieces: list[str], sep: str) -> list[str]:
    """`pieces` joined by `sep` into as few runs as fit MAX_CHARS and MAX_TOKENS, in order."""
    out, current, chars, tokens = [], "", 0, 0.0
    for piece in pieces:
        size = estimated_tokens(piece)
        if current and (chars + len(sep) + len(piece) > MAX_CHARS or tokens + size > MAX_TOKENS):
            out.append(current)
            current, chars, tokens = "", 0, 0.0
        current = f"{current}{sep}{piece}" if current else piece
        chars, tokens = len(current), tokens + size
    if current:
        out.append(current)
    return out


def parts(text: str) -> list[str]:
    """`text` as one part, or cut at paragraph breaks into parts within MAX_CHARS and MAX_TOKENS
    (a longer paragraph is cut at line breaks, a line at LINE_CHARS); parts under MIN_CHARS and
    mostly non-prose parts left out."""
    pieces = []
    for block in _blocks(text):
        lines = [line[i:i + LINE_CHARS] for line in block.split("\n") for i in range(0, max(len(line), 1), LINE_CHARS)]
        pieces.extend(_pack(lines, "\n"))
    return [p for p in _pack(pieces, "\n\n") if len(p) >= MIN_CHARS and _readable(p)]


def _readable(text: str) -> bool:
    """Mostly words (code samples are fine, tables of numbers and link lists are not)."""
    dense = "".join(text.split())
    return sum(map(str.isalpha, dense)) >= 0.55 * len(dense) and text.count("http") <= 12


def _docstrings(source: str, module: str) -> Iterator[tuple[str, str]]:
    """(qualified name, docstring) of a module (`source`: its text) and its public classes and
    functions (top level and methods of public classes), in source order."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    if doc := ast.get_docstring(tree):
        yield module, doc
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    for node in tree.body:
        if not isinstance(node, kinds) or node.name.startswith("_"):
            continue
        if doc := ast.get_docstring(node):
            yield f"{module}.{node.name}", doc
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, kinds) and not sub.name.startswith("_") and (doc := ast.get_docstring(sub)):
                    yield f"{module}.{node.name}.{sub.name}", doc


def python_documents(stdlib: Path) -> Iterator[Document]:
    """The reference topics of `help()`, then the long docstrings of the standard library."""
    try:
        from pydoc_data.topics import topics  # noqa: PLC0415 - not a project import; absent from some builds
    except ImportError:
        topics = {}
    for name in sorted(topics):
        yield Document(f"topic:{name}", f'the Python language reference topic "{name}"', "python", topics[name])
    for path in iter_py_files(stdlib):
        module = ".".join(path.relative_to(stdlib).with_suffix("").parts).removesuffix(".__init__")
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for qualname, doc in _docstrings(source, module):
            if len(doc) >= MIN_CHARS:
                what = "module" if qualname == module else "API"
                yield Document(f"doc:{qualname}", f"the documentation of Python's `{qualname}` {what}", "python", doc)


def _doc_files(dist: metadata.Distribution) -> list[Path]:
    """The documentation files a distribution installs, sorted (relative to its location)."""
    out = []
    for file in dist.files or []:
        rel = Path(str(file))
        if (rel.suffix.lower() not in DOC_SUFFIXES or _NOT_DOCS.match(rel.name) or skipped(rel)
                or rel.parts[0].endswith((".dist-info", ".egg-info", ".data")) or rel.parts[0].lower() in NEVER_READ):
            continue
        out.append(rel)
    return sorted(out)


def package_documents(licences: dict[str, str], path: list[str] | None = None, workers: int = 1) -> Iterator[Document]:
    """READMEs, documentation files and API docstrings (`api_documents`, parsed in `workers`
    processes) of the installed distributions with a permissive licence (`path`: where to look
    instead of sys.path); `licences` gets name -> licence of each one read."""
    dists = list(permissive_distributions(path))
    apis = api_documents([(name, dist) for name, dist, _ in dists], workers)
    for (name, dist, licence), api in zip(dists, apis):
        readme = dist.metadata.get("Description") or dist.metadata.get_payload() or ""
        files = _doc_files(dist)
        if not (isinstance(readme, str) and readme.strip()) and not files and not api:
            continue
        licences[name] = licence
        if isinstance(readme, str) and readme.strip():
            yield Document(f"pkg:{name}", f"the README of the Python package `{name}`", "package", readme)
        for rel in files:
            file = Path(str(dist.locate_file(rel)))
            if file.is_file() and file.stat().st_size <= MAX_FILE_BYTES:
                text = file.read_text(encoding="utf-8", errors="replace")
                yield Document(f"file:{name}/{rel.as_posix()}", f"`{rel.as_posix()}` from the Python package `{name}`",
                               "package", text)
        yield from api


def _has_long_string(text: str) -> bool:
    """Whether two like triple quotes stand at least MIN_CHARS apart: a cheap test before parsing."""
    for quote in ('"""', "'''"):
        marks = [m.start() for m in re.finditer(quote, text)]
        if any(b - a >= MIN_CHARS for a, b in zip(marks, marks[1:])):
            return True
    return False


def _api_files(dist: metadata.Distribution) -> list[tuple[str, str]]:
    """(path, module) of the Python files a distribution installs that may hold API docstrings
    (tests, vendored code and files over MAX_PY_BYTES left out), in the distribution's order."""
    out = []
    for file in dist.files or []:
        rel = Path(str(file))
        if (rel.suffix != ".py" or skipped(rel) or rel.parts[0].endswith((".dist-info", ".egg-info", ".data"))
                or rel.parts[0].lower() in NEVER_READ):
            continue
        path = Path(str(dist.locate_file(rel)))
        if path.is_file() and path.stat().st_size <= MAX_PY_BYTES:
            out.append((str(path), ".".join(rel.with_suffix("").parts).removesuffix(".__init__")))
    return out


def _file_api_documents(task: tuple[str, str, str]) -> list[Document]:
    """The long docstrings (>= MIN_CHARS) of one file; `task`: (distribution name, path, module)."""
    name, path, module = task
    try:
        source = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return []
    if not _has_long_string(source):
        return []
    return [Document(f"api:{name}/{qualname}", f"the documentation of `{qualname}` from the Python package `{name}`",
                     "python", doc)
            for qualname, doc in _docstrings(source, module) if len(doc) >= MIN_CHARS]


def api_documents(dists: list[tuple[str, metadata.Distribution]], workers: int = 1) -> list[list[Document]]:
    """For each (name, distribution): the long docstrings of the Python files it installs, at most
    MAX_API_DOCS, drawn by a hash of their names and returned in name order. Parsing is most of
    the source's time, so the files of all distributions are parsed in `workers` processes."""
    tasks = [(k, name, path, module) for k, (name, dist) in enumerate(dists) for path, module in _api_files(dist)]
    found = ordered_map(_file_api_documents, [task[1:] for task in tasks], workers)
    per_dist: list[list[Document]] = [[] for _ in dists]
    for (k, *_), docs in zip(tasks, found):
        per_dist[k].extend(docs)
    for k, docs in enumerate(per_dist):
        if len(docs) > MAX_API_DOCS:
            docs = sorted(docs, key=lambda d: group_hash("long-docs", d.name))[:MAX_API_DOCS]
        per_dist[k] = sorted(docs, key=lambda d: d.name)
    return per_dist


# -- requests ------------------------------------------------------------------------------------------

STYLES = ("summarize", "extract-list", "extract-json", "extract-steps", "question")
_SUMMARY = ("Summarize the following document in one paragraph.",
            "Summarize this document in five bullet points, most important first.",
            "Give a three-sentence summary of the document: what it is about, its main points, and who would "
            "need it.",
            "Write a short summary of this document for someone who has not read it, then list the three things "
            "from it that are most worth remembering.")
_LISTS = {
    "functions": "List every function or method the document mentions, each with one line on what it does "
                 "according to the text.",
    "options": "List every command-line option the document mentions, each with what it does according to the "
               "text.",
    "versions": "List every version number and date the document mentions, each with what the document says "
                "about it.",
    "names": "List every class, function, module, parameter or keyword the document names, grouped by kind, "
             "each with a short description taken from the text.",
    "terms": "List the technical terms the document uses, each with a one-line definition based on the text.",
}
_FIELDS = {
    "python": ('"subject"', '"summary"', '"syntax_or_signature"', '"parameters": []', '"rules": []',
               '"exceptions_raised": []', '"examples": []', '"related_names": []'),
    "package": ('"name"', '"purpose"', '"install_command"', '"requirements": []', '"main_features": []',
                '"usage_example"', '"license"', '"links_or_resources": []'),
    "changelog": ('"releases": [{"version": null, "date": null, "changes": [], "breaking_changes": []}]',),
}
_JSON = ("Read the document and fill in this JSON object from it. Use null (or an empty list) for anything the "
         "document does not say, and answer with the JSON only.\n\n{{{fields}}}")
_STEPS = ("Extract every instruction or step the document gives (what a reader should do, in order) as a "
          "numbered list. If the document gives no steps, say so and list its main rules instead.",
          "Pull out the procedure described in this document as numbered steps, with any command or code each "
          "step needs.")
_QUESTION = {
    "section": 'What does the section "{x}" of the document explain? Answer from the document only.',
    "function": "According to the document, what does `{x}()` do, and how is it used? Answer from the document "
                "only and quote the sentence that supports your answer.",
    "option": "According to the document, what does the `{x}` option do? Answer from the document only.",
    "name": "What does the document say about `{x}`? Answer from the document only, and say so if it does not "
            "explain it.",
    "main": "Based only on the document, what problem does its subject solve, and what are its limits or "
            "caveats?",
}
_LAYOUTS = ("{ask}\n\nThe document ({title}):\n\n{doc}",
            "Here is {title}:\n\n<document>\n{doc}\n</document>\n\n{ask}",
            'Read {title} below and answer.\n\n"""\n{doc}\n"""\n\n{ask}')


def _distinct(found: list[str]) -> list[str]:
    return sorted(set(found))


def headings(text: str) -> list[str]:
    """Section titles: Markdown `#` lines and underlined (reST, pydoc) lines, in order, once each."""
    found = sorted([(m.start(), m.group(1).strip()) for m in _HEADING_MD.finditer(text)]
                   + [(m.start(), m.group(1).strip()) for m in _HEADING_RST.finditer(text)])
    return list(dict.fromkeys(title for _, title in found))


def mentions(text: str) -> dict[str, list[str]]:
    """What a part names, by kind (sorted, each once): the material of extract-list and question."""
    return {"section": headings(text)[1:],  # the first heading is usually the document's title
            "function": _distinct(_FUNCTION.findall(text)), "option": _distinct(_OPTION.findall(text)),
            "version": _distinct(_VERSION_OR_DATE.findall(text)), "name": _distinct(_CODE_NAME.findall(text))}


def request(doc: Document, part: str, title: str, style: str, found: dict[str, list[str]],
            rng: random.Random) -> str:
    """The request of one style about one part called `title` (every style applies to every part)."""
    if style == "summarize":
        ask = rng.choice(_SUMMARY)
    elif style == "extract-list":
        kinds = [k for k, m in (("functions", "function"), ("options", "option"), ("versions", "version"),
                                ("names", "name")) if len(found[m]) >= 3]
        ask = _LISTS[rng.choice(kinds)] if kinds else _LISTS["terms"]
    elif style == "extract-json":  # a part that names many versions is (mostly) a changelog
        fields = _FIELDS["changelog" if len(found["version"]) >= 5 else doc.kind]
        ask = _JSON.format(fields=", ".join(f if f.endswith(("]", "}")) else f + ": null" for f in fields))
    elif style == "extract-steps":
        ask = rng.choice(_STEPS)
    elif style == "question":
        kinds = [k for k in ("section", "function", "option", "name") if found[k]]
        kind = rng.choice(kinds) if kinds else "main"
        ask = _QUESTION[kind].format(x=rng.choice(found[kind]) if kinds else "")
    else:
        raise ValueError(f"unknown style {style!r}")
    return rng.choice(_LAYOUTS).format(ask=ask, title=title, doc=part)


def long_doc_prompts(docs: Iterator[Document], *, source: str, seed: int, per_document: int = 1) -> list[PromptItem]:
    """`per_document` requests (distinct styles) about each kept part of every document, in order."""
    items = []
    for doc in docs:
        cut = parts(clean(doc.text))
        kept = list(enumerate(cut))
        if len(kept) > MAX_PARTS:
            kept = [kept[i] for i in sorted(random.Random(f"{seed}:{doc.name}").sample(range(len(kept)), MAX_PARTS))]
        for k, part in kept:
            rng = random.Random(f"{seed}:{doc.name}:{k}")
            styles = list(STYLES)
            rng.shuffle(styles)
            found = mentions(part)
            title = doc.title if len(cut) == 1 else f"part {k + 1} of {len(cut)} of {doc.title}"
            items.extend(PromptItem(source, style, doc.name, request(doc, part, title, style, found, rng))
                         for style in styles[:per_document])
    return items
