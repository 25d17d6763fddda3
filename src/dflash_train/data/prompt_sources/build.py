"""Build the prompt files of `dflash-train prompts`: collect every source, guard against
HumanEval, de-duplicate across sources, hold out whole groups per source, write JSONL
(train/<source>[-<k>of<N>].jsonl, heldout/<source>-heldout.jsonl, manifest.json).

Order of work (each step is counted per source in manifest.json):

1. collect each source's prompts (`python_code.py`, `text_docs.py`, `math_problems.py`, `long_docs.py`);
2. the HumanEval guard (`guard.py`) on every prompt: any match stops the run, naming the prompt
   and the HumanEval task, before anything is written;
3. exact duplicates (case/whitespace-insensitive) go, the first occurrence kept, sources in the
   order given; then a prompt whose word 3-grams have Jaccard >= `dedup_threshold` with one of an
   earlier source's goes (`dedup.near_duplicate_of`, n-grams in > 5% of the earlier prompts left
   out as boilerplate, as `data/splits.py` does);
4. held-out split per source by group (all prompts of one function or document): groups in
   the order of a seeded hash of (source, group) go to held-out until it holds
   min(heldout, heldout_fraction x prompts); held-out prompts that near-duplicate any training
   prompt are dropped (counted), so held-out means unseen;
5. training prompts are shuffled (seeded), cut to `limit`, dealt round-robin into `shards` files.

The same options, seed and installed files give byte-identical output.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from dflash_train.data.dedup import common_shingles, mix64, near_duplicate_of
from dflash_train.data.prompt_sources.config import PromptsConfig
from dflash_train.data.prompt_sources.guard import HumanEvalGuard, Match
from dflash_train.data.prompt_sources.items import PromptItem, group_hash, normalize, word_ids
from dflash_train.data.prompt_sources.long_docs import long_doc_prompts, package_documents, python_documents
from dflash_train.data.prompt_sources.math_problems import math_prompts
from dflash_train.data.prompt_sources.python_code import code_prompts, package_roots, stdlib_root
from dflash_train.data.prompt_sources.text_docs import document_prompts, package_descriptions, python_docs
from dflash_train.data.sources import iter_records
from dflash_train.utils.device import idle_cores
from dflash_train.utils.errors import DataError, InputError, OutputError
from dflash_train.utils.fs import atomic_directory_write, made_by

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # part of the "same options" check: bump when the output for given options changes
NGRAM = 3
JOB = "prompts"


class HumanEvalLeak(DataError):
    """Prompts that near-duplicate HumanEval: the evaluation set must stay out of training."""


@dataclass
class SourceReport:
    candidates: int = 0
    exact_duplicates: int = 0
    near_duplicates: int = 0  # of a prompt of an earlier source
    train: int = 0
    train_over_limit: int = 0
    heldout: int = 0
    heldout_groups: int = 0
    heldout_dropped: int = 0  # near-duplicates of a training prompt
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    provenance: dict[str, str] = field(default_factory=dict)  # what was read -> licence


def stdlib_directory(cfg: PromptsConfig) -> Path:
    """The standard library the sources read. A missing one is an error when a source that
    needs it is asked for (else it gives 0 prompts and exit 0). The job checks it before the
    HumanEval guard loads, so a mistyped --stdlib is named whatever else the machine lacks."""
    stdlib = Path(cfg.stdlib) if cfg.stdlib else stdlib_root()
    if not stdlib.is_dir() and {"stdlib-code", "python-docs"} & set(cfg.sources):
        raise InputError(f"--stdlib {stdlib}: not a directory; give the standard library's directory, or leave "
                         f"--stdlib out to read this interpreter's")
    return stdlib


def _reads(cfg: PromptsConfig, name: str) -> str:
    """What a source reads, for a message."""
    if name in ("stdlib-code", "python-docs", "long-docs"):
        return f"the standard library at {stdlib_directory(cfg)} (--stdlib)"
    if name in ("package-code", "package-docs"):
        return "the installed packages"
    return "its generator"


def collect(cfg: PromptsConfig, name: str, report: SourceReport) -> list[PromptItem]:
    """The prompts of one source, in a fixed order."""
    stdlib = stdlib_directory(cfg)
    workers = cfg.workers or idle_cores()
    if name == "stdlib-code":
        report.provenance[f"Python {platform.python_version()} standard library ({stdlib})"] = "PSF-2.0"
        return code_prompts([("stdlib", stdlib)], source=name, seed=cfg.seed,
                            styles_per_function=cfg.styles_per_function, workers=workers)
    if name == "package-code":
        roots = package_roots()
        for dist, directory, licence in roots:
            report.provenance[f"{dist} ({directory.name})"] = licence
        return code_prompts([(f"{dist}/{d.name}", d) for dist, d, _ in roots], source=name, seed=cfg.seed,
                            styles_per_function=cfg.styles_per_function,
                            max_functions_per_root=cfg.max_functions_per_package, workers=workers)
    if name == "python-docs":
        report.provenance[f"Python {platform.python_version()} documentation, docstrings ({stdlib})"] = "PSF-2.0"
        return document_prompts(python_docs(stdlib), source=name, seed=cfg.seed, code_styles=True,
                                per_passage=cfg.styles_per_function)
    if name == "package-docs":
        return document_prompts(package_descriptions(report.provenance), source=name, seed=cfg.seed,
                                code_styles=False, per_passage=cfg.styles_per_function)
    if name == "math":
        report.provenance["templated problems (math_problems.py)"] = "this project (Apache-2.0)"
        return math_prompts(cfg.math_count, seed=cfg.seed, source=name)
    if name == "long-docs":
        report.provenance[f"Python {platform.python_version()} documentation, docstrings ({stdlib})"] = "PSF-2.0"
        docs = itertools.chain(python_documents(stdlib), package_documents(report.provenance, workers=workers))
        return long_doc_prompts(docs, source=name, seed=cfg.seed, per_document=cfg.styles_per_document)
    raise ValueError(f"unknown source {name!r}")


def leak_error(where: str, matches: list[Match], describe: Callable[[int], str]) -> HumanEvalLeak:
    shown = "; ".join(f"{describe(m.candidate)} ~ {m.reference} (overlap {m.overlap}, {m.shared} shared 3-grams)"
                      for m in matches[:5])
    more = f" and {len(matches) - 5} more" if len(matches) > 5 else ""
    return HumanEvalLeak(where, None, None, f"{len(matches)} prompt(s) near-duplicate HumanEval, the evaluation "
                                            f"set, which must stay out of training: {shown}{more}")


def _seeded_order(keys: list[int], seed: int) -> np.ndarray:
    """A permutation of range(len(keys)) fixed by (seed, key): adding keys never reorders the others."""
    values = mix64(np.array(keys, np.uint64) ^ mix64(np.array([seed % 2**64], np.uint64))[0])
    return np.argsort(values, kind="stable")


class WordIds:
    """`word_ids` of prompts, each computed once: the de-duplication passes read the same
    prompts again and again (every earlier source, then all training prompts)."""

    def __init__(self) -> None:
        self._ids: dict[str, np.ndarray] = {}

    def __call__(self, items: list[PromptItem]) -> list[np.ndarray]:
        out = []
        for p in items:
            ids = self._ids.get(p.text)
            if ids is None:
                ids = self._ids[p.text] = word_ids(p.text)
            out.append(ids)
        return out


def _near(queries: list[PromptItem], corpus: list[PromptItem], threshold: float, seed: int,
          ids: WordIds | None = None) -> np.ndarray:
    if threshold <= 0 or not queries or not corpus:
        return np.zeros(len(queries), bool)
    ids = ids or WordIds()
    corpus_ids = ids(corpus)
    ignore = common_shingles(corpus_ids, NGRAM, min_fraction=0.05, min_count=10, seed=seed)
    return near_duplicate_of(ids(queries), corpus_ids, threshold=threshold, ngram=NGRAM, seed=seed, ignore=ignore)


def split_heldout(items: list[PromptItem], cfg: PromptsConfig) -> tuple[list[PromptItem], list[PromptItem], int]:
    """(train, held-out, held-out groups): whole groups, drawn in seeded order, until the target count."""
    target = min(cfg.heldout, int(cfg.heldout_fraction * len(items)))
    groups: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault(item.group, []).append(i)
    names = list(groups)
    held: set[int] = set()
    n_groups = 0
    for g in _seeded_order([group_hash(items[0].source, n) for n in names], cfg.seed).tolist() if target else []:
        if len(held) >= target:
            break
        held.update(groups[names[g]])
        n_groups += 1
    train = [p for i, p in enumerate(items) if i not in held]
    heldout = [p for i, p in enumerate(items) if i in held]
    return train, heldout, n_groups


def build_sets(cfg: PromptsConfig, guard: HumanEvalGuard) -> tuple[dict[str, list[PromptItem]],
                                                                   dict[str, list[PromptItem]],
                                                                   dict[str, SourceReport]]:
    """(train prompts, held-out prompts, report) per source: steps 1-5 of the module doc."""
    reports = {name: SourceReport() for name in cfg.sources}
    collected = {}
    for name in cfg.sources:
        t0 = time.perf_counter()
        collected[name] = collect(cfg, name, reports[name])
        if not collected[name]:  # said now: an empty source would be a training set without it, exit 0
            raise InputError(f"--sources {name}: no prompt found in {_reads(cfg, name)}; give it something to read, "
                             f"or leave it out of --sources")
        reports[name].candidates = len(collected[name])
        log.info("%s: %d candidate prompts (%.1f s)", name, len(collected[name]), time.perf_counter() - t0)
        found = guard.matches([p.text for p in collected[name]])
        if found:
            items = collected[name]
            raise leak_error(f"source {name}", found, lambda i: f"{items[i].id} ({items[i].group})")
    kept: dict[str, list[PromptItem]] = {}
    ids = WordIds()
    seen: set[str] = set()
    earlier: list[PromptItem] = []
    for name in cfg.sources:
        unique = []
        for item in collected[name]:
            key = normalize(item.text)
            if key in seen:
                reports[name].exact_duplicates += 1
                continue
            seen.add(key)
            unique.append(item)
        near = _near(unique, earlier, cfg.dedup_threshold, cfg.seed, ids)
        reports[name].near_duplicates = int(near.sum())
        kept[name] = [p for p, dup in zip(unique, near) if not dup]
        earlier.extend(kept[name])
    train, heldout = {}, {}
    for name in cfg.sources:
        train[name], heldout[name], reports[name].heldout_groups = split_heldout(kept[name], cfg) if kept[name] \
            else ([], [], 0)
    all_train = [p for name in cfg.sources for p in train[name]]
    for name in cfg.sources:
        dup = _near(heldout[name], all_train, cfg.dedup_threshold, cfg.seed, ids)
        reports[name].heldout_dropped = int(dup.sum())
        heldout[name] = [p for p, d in zip(heldout[name], dup) if not d]
        order = _seeded_order([int(hashlib.blake2b(p.id.encode(), digest_size=8).hexdigest(), 16)
                               for p in train[name]], cfg.seed)
        shuffled = [train[name][i] for i in order.tolist()]
        if cfg.limit and len(shuffled) > cfg.limit:
            reports[name].train_over_limit = len(shuffled) - cfg.limit
            shuffled = shuffled[:cfg.limit]
        train[name] = shuffled
        reports[name].train, reports[name].heldout = len(shuffled), len(heldout[name])
    return train, heldout, reports


def options_key(cfg: PromptsConfig) -> dict:
    """What decides the output (besides the installed files): compared on a rerun."""
    opts = {k: v for k, v in asdict(cfg).items() if k not in ("output", "overwrite", "check", "workers")}
    return {"format_version": FORMAT_VERSION, "python": platform.python_version(), **opts}


def _write_jsonl(path: Path, items: list[PromptItem]) -> str:
    data = "".join(json.dumps(p.to_row(), ensure_ascii=False) + "\n" for p in items).encode()
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def shard_name(source: str, k: int, shards: int) -> str:
    return f"{source}.jsonl" if shards == 1 else f"{source}-{k}of{shards}.jsonl"


def build(cfg: PromptsConfig, guard: HumanEvalGuard | None = None) -> tuple[dict, bool]:
    """(manifest, whether it was written now): an output built with the same options is kept
    (the recipe reruns this step); one built with other options needs `overwrite`."""
    out = Path(cfg.output)
    manifest_path = out / "manifest.json"
    if manifest_path.is_file() and made_by(out) == JOB:
        old = json.loads(manifest_path.read_text())
        if old.get("options") == options_key(cfg) and not cfg.overwrite:
            return old, False
        if not cfg.overwrite:
            raise OutputError(f"{out} holds prompts built with other options; pass --overwrite to rebuild it")
    elif out.exists() and any(out.iterdir()) and made_by(out) != JOB:
        raise OutputError(f"{out} exists and was not written by `dflash-train prompts`: choose another output")
    t0 = time.perf_counter()
    guard = guard or HumanEvalGuard.humaneval(cfg.humaneval_file, threshold=cfg.humaneval_threshold)
    train, heldout, reports = build_sets(cfg, guard)
    manifest = {"format_version": FORMAT_VERSION, "options": options_key(cfg), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "python": sys.version.split()[0], "humaneval_guard": {"references": len(guard.names),
                                                                       "threshold": guard.threshold, "matches": 0},
                "sources": {}}

    def write_into(tmp: Path) -> None:
        (tmp / "train").mkdir()
        (tmp / "heldout").mkdir()
        for name in cfg.sources:
            rep = reports[name]
            for k in range(cfg.shards):
                rel = f"train/{shard_name(name, k, cfg.shards)}"
                rep.files[rel] = _write_jsonl(tmp / rel, train[name][k::cfg.shards])
            rel = f"heldout/{name}-heldout.jsonl"  # a name no training shard has: generated rows say their file
            rep.files[rel] = _write_jsonl(tmp / rel, heldout[name])
            manifest["sources"][name] = asdict(rep)
        manifest["seconds"] = round(time.perf_counter() - t0, 1)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")

    atomic_directory_write(out, write_into, job=JOB)
    return manifest, True


def check_files(paths: list[str], guard: HumanEvalGuard) -> int:
    """Rows checked; raises HumanEvalLeak naming file:line:field of the first matches. The user and
    system turns (or `text`) of every row are checked: answers are the target's own writing, and a
    correct answer to a similar request may well resemble a HumanEval solution."""
    texts, where = [], []
    for record in iter_records(paths):
        if record.messages is None:
            texts.append(record.text or "")
            where.append((record.file, record.line, "text"))
            continue
        for k, message in enumerate(record.messages):
            if message["role"] in ("user", "system"):
                texts.append(message["content"])
                where.append((record.file, record.line, f"messages[{k}].content"))
    found = guard.matches(texts)
    if found:
        first = where[found[0].candidate]
        raise leak_error(first[0], found, lambda i: f"{where[i][0]}:{where[i][1]} field '{where[i][2]}'")
    return len({(f, n) for f, n, _ in where})
