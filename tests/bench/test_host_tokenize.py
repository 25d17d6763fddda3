"""bench/host_tokenize.py on a tiny ChatML tokenizer: both ways agree, and the table is filled."""

from __future__ import annotations


import pytest

from tests.generate.tiny import make_model, make_tokenizer

from .scripts import load_script

host_tokenize = load_script("bench/host_tokenize.py")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """A tiny model directory (config and weights, as a target is) with a ChatML tokenizer."""
    path = tmp_path_factory.mktemp("tok")
    tokenizer = make_tokenizer()
    make_model("llama", vocab=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_both_ways_agree_and_every_time_is_reported(tokenizer_dir, tmp_path):
    out = tmp_path / "ht.json"
    r = host_tokenize.main(["--target", str(tokenizer_dir), "--batch", "7", "--repeats", "2", "--out", str(out)])
    assert out.exists() and r["config"]["batch"] == 7 and r["config"]["prompts"] == "chat"
    assert all(r[k] > 0 for k in ("encode_one_by_one_ms", "encode_batched_ms", "decode_one_by_one_ms",
                                  "decode_batched_ms", "tokens_per_request"))


def test_a_batch_below_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        host_tokenize.main(["--batch", "0"])
    assert exit_info.value.code == 2 and "--batch and --repeats must be >= 1" in capsys.readouterr().err
