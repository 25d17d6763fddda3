"""The one record every prompt source yields, and the word-level token ids that de-duplication and
the HumanEval guard compare (`data/dedup.py` works on integer sequences)."""

from __future__ import annotations

import hashlib
import re
import zlib
from dataclasses import dataclass

import numpy as np

_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class PromptItem:
    source: str  # the source's name, e.g. "stdlib-code"
    style: str  # the kind of request, e.g. "write", "explain", "word-problem"
    group: str  # prompts of one group go to the same side of the held-out split (e.g. one function)
    text: str  # the user turn

    @property
    def id(self) -> str:
        digest = hashlib.blake2b(self.text.encode(), digest_size=6).hexdigest()
        return f"{self.source}:{self.style}:{digest}"

    def to_row(self) -> dict:
        """A row `dflash-train generate --prompts` regenerates (the empty assistant turn is what the
        target writes) and `dflash-train eval --prompts FILE` reads (it drops that turn)."""
        return {"id": self.id, "source": self.source, "style": self.style, "group": self.group,
                "messages": [{"role": "user", "content": self.text}, {"role": "assistant", "content": ""}]}


def normalize(text: str) -> str:
    """The exact-duplicate key: case- and whitespace-insensitive."""
    return " ".join(text.lower().split())


def word_ids(text: str) -> np.ndarray:
    """uint64 [W]: one id per lower-cased word (CRC-32: stable across processes, unlike hash()).
    Maps over builtins, not a generator: the de-duplication passes call it for every row."""
    words = _WORD.findall(text.lower())
    return np.fromiter(map(zlib.crc32, map(str.encode, words)), np.uint64, count=len(words))


def group_hash(source: str, group: str) -> int:
    """uint64 value of a (source, group) key, the input of the seeded held-out draw."""
    return int.from_bytes(hashlib.blake2b(f"{source}\0{group}".encode(), digest_size=8).digest(), "little")
