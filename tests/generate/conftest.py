"""Fixtures for the generate tests: a tiny tokenizer and a tiny model saved like a target."""

from __future__ import annotations

import pytest
import torch

from .tiny import make_model, make_tokenizer


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine the
    thread hand-offs cost more than the matmuls; restore the setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama saved like a real target directory (config, safetensors, tokenizer)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    model = make_model("llama", vocab=len(tokenizer))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
