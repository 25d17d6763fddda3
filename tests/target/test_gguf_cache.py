"""GGUF targets read from their converted folder in the cache (target/gguf_cache.py)."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import SafetensorError

from dflash_train.target import gguf_cache
from dflash_train.target.loading import (BUILTIN_GGUF, load_causal_lm, load_tokenizer, resolve_model_source,
                                         tokenizer_identity)


def fake_gguf(tmp_path, name="m.gguf", payload=b"GGUF not really"):
    path = tmp_path / "models" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(payload)
    return path


def counting_convert(calls):
    def convert(gguf, out):
        calls.append(gguf)
        (out / "config.json").write_text("{}")
    return convert


def test_converts_once_then_reads_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(gguf_cache, "_convert", counting_convert(calls))
    gguf = fake_gguf(tmp_path)
    first = gguf_cache.cached_folder(gguf)
    assert first is not None and (first / "config.json").is_file() and (first / gguf_cache.COMPLETE).is_file()
    assert gguf_cache.cached_folder(gguf) == first and len(calls) == 1
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no staging folder left behind
    # another file (other content) gets a folder of its own
    other = fake_gguf(tmp_path, "n.gguf", b"other bytes")
    assert gguf_cache.cached_folder(other) not in (None, first) and len(calls) == 2


def test_a_failed_conversion_leaves_nothing(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))

    def broken(gguf, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_cache, "_convert", broken)
    with caplog.at_level(logging.WARNING):
        assert gguf_cache.cached_folder(fake_gguf(tmp_path)) is None
    assert "disk full" in caplog.text and "reading the GGUF file instead" in caplog.text
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_a_full_disk_while_writing_the_weights_falls_back_to_the_gguf(tmp_path, monkeypatch, caplog):
    """safetensors reports ENOSPC as its own SafetensorError, not as an OSError."""
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_cache.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: torch.nn.Linear(4, 4))

    def disk_full(state, path, metadata=None):
        open(path, "wb").write(b"half")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(gguf_cache, "save_file", disk_full)
    with caplog.at_level(logging.WARNING):
        assert gguf_cache.cached_folder(fake_gguf(tmp_path)) is None
    assert "No space left on device" in caplog.text and "reading the GGUF file instead" in caplog.text
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_an_error_of_the_file_itself_is_raised_and_cleaned_up(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(tmp_path / "cache"))

    def unreadable(gguf, out):
        raise ValueError("not a GGUF file")

    monkeypatch.setattr(gguf_cache, "_convert", unreadable)
    with pytest.raises(ValueError, match="not a GGUF"):  # what loading the GGUF itself would say
        gguf_cache.cached_folder(fake_gguf(tmp_path))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


@pytest.mark.parametrize("setting", ["off", "0", ""])
def test_off(tmp_path, monkeypatch, setting):
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", setting)
    monkeypatch.setattr(gguf_cache, "_convert", counting_convert(calls := []))
    assert gguf_cache.cached_folder(fake_gguf(tmp_path)) is None and calls == []


def test_an_unwritable_cache_falls_back_to_the_gguf(tmp_path, monkeypatch):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache directory should be")
    monkeypatch.setenv("DFLASH_TRAIN_CACHE", str(blocker))
    monkeypatch.setattr(gguf_cache, "_convert", counting_convert(calls := []))
    gguf = fake_gguf(tmp_path)
    assert gguf_cache.cached_folder(gguf) is None and calls == []
    source = resolve_model_source(str(gguf))
    assert source.gguf_file == "m.gguf" and source.directory == gguf.parent and source.describe() == str(gguf)


def test_default_location_follows_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_TRAIN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.cache_root() == tmp_path / "xdg" / "dflash-train"


@pytest.mark.slow
def test_the_builtin_target_from_the_cache_equals_the_gguf(builtin_gguf_reference):
    """Same weights (bit for bit), config and tokenizer as transformers' own GGUF load.
    (The fixture loads the GGUF directly and makes the suite's shared cache folder from that
    load; tests/conftest.py points DFLASH_TRAIN_CACHE at a temp dir.)"""
    ref_model, ref_tok, direct = builtin_gguf_reference
    assert direct.gguf_file == BUILTIN_GGUF
    cached = resolve_model_source("builtin")
    assert cached.gguf_file is None and cached.describe().endswith(BUILTIN_GGUF)
    model, tok = load_causal_lm(cached), load_tokenizer(cached)
    ref_state, state = ref_model.state_dict(), model.state_dict()
    assert state.keys() == ref_state.keys()
    assert all(v.dtype == torch.float32 and torch.equal(v, ref_state[k]) for k, v in state.items())
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
                "bos_token_id", "eos_token_id", "hidden_act", "model_type"):
        assert getattr(model.config, key, None) == getattr(ref_model.config, key, None), key
    identity, ref_identity = tokenizer_identity(tok), tokenizer_identity(ref_tok)
    assert {k: v for k, v in identity.items() if k != "name"} == {k: v for k, v in ref_identity.items() if k != "name"}
    chat = [{"role": "user", "content": "Write a haiku about caches."}, {"role": "assistant", "content": "Fast."}]
    assert tok.apply_chat_template(chat, tokenize=False) == ref_tok.apply_chat_template(chat, tokenize=False)
    text = "def f(x):\n    return x ** 2  # ünïcode, émoji 🙂"
    assert tok(text)["input_ids"] == ref_tok(text)["input_ids"]
    assert (tok.eos_token, tok.bos_token, tok.pad_token) == (ref_tok.eos_token, ref_tok.bos_token, ref_tok.pad_token)
    ids = torch.tensor([tok(text)["input_ids"]])
    with torch.no_grad():  # the same forward, not only the same tensors (the config drives the layers)
        assert torch.equal(model(ids).logits, ref_model(ids).logits)
