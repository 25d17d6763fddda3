"""Model directories of the tiny families of tests/families.py with the suite's ChatML tokenizer
(tests/conftest.py), for tests that need a target on disk but not the family's own chat template."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import build_tokenizer
from tests.families import build_model


def save_tiny_family(name: str, directory: Path, seed: int = 0):
    """Tokenizer + random model of family `name` saved to `directory` (a few embedding rows past the
    tokenizer: an unused row for the drafter's MASK token); returns (model, tokenizer)."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(directory)
    model = build_model(name, len(tokenizer) + 8, seed)
    model.save_pretrained(str(directory), safe_serialization=True)
    return model, tokenizer
