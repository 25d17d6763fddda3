"""`dflash-train bench --levers`: the lever table of the target forward, on the tiny preset (CPU)."""

import json

import pytest

from dflash_train.bench import cli as bench
from dflash_train.bench.cli import BenchConfig, best_bf16_settings, format_lever_table, run
from dflash_train.train.config import TrainConfig
from dflash_train.utils.config import load_config
from dflash_train.utils.errors import ConfigError, OutputError

TINY = {"preset": "tiny", "tokens": 256, "doc_len": "40-120", "anchors": 8, "block": 4, "layers": 1, "warmup": 1,
        "measure": 2, "device": "cpu"}


def test_lever_table_rows_train_on_the_same_taps(tmp_path, capsys):
    """Rows of several documents per row; the packed and the look-ahead target give the
    drafter the same numbers as the Hugging Face forward, so training ends at the same loss."""
    out = tmp_path / "levers.json"
    assert run(BenchConfig(**TINY, levers="baseline,packed,packed-grouped-kv", out=str(out))) == 0
    assert run(BenchConfig(**TINY, levers="overlap,data-labels", out=str(out), append=True)) == 0  # one table
    table = json.loads(out.read_text())
    rows = {r["name"]: r for r in table["rows"]}
    assert list(rows) == ["baseline", "packed", "packed-grouped-kv", "overlap", "data-labels"]
    for r in rows.values():
        assert "error" not in r and r["tokens_per_s"] > 0 and r["target_ms"] > 0 and r["drafter_ms"] > 0
    assert rows["packed"]["settings"]["target_forward"] == "packed" and rows["overlap"]["settings"]["overlap"]
    assert rows["packed"]["loss_last"] == pytest.approx(rows["baseline"]["loss_last"], rel=1e-5)
    assert rows["packed-grouped-kv"]["settings"]["grouped_kv"] and not rows["packed"]["settings"]["grouped_kv"]
    assert rows["packed-grouped-kv"]["loss_last"] == pytest.approx(rows["baseline"]["loss_last"], rel=1e-5)
    assert rows["overlap"]["loss_last"] == pytest.approx(rows["baseline"]["loss_last"], rel=1e-5)
    assert rows["data-labels"]["loss_last"] != pytest.approx(rows["baseline"]["loss_last"], rel=1e-3)
    printed = capsys.readouterr().out
    assert "| lever | tok/s |" in printed and "| overlap |" in printed


def _table(path, rows):
    path.write_text(json.dumps({"rows": rows}))
    return str(path)


def _row(name, tok_s, **settings):
    base = {"target_forward": "hf", "target_compile": False, "sdpa_backend": "auto", "overlap": False,
            "fp8_target": False, "labels": "target"}
    return {"name": name, "tokens_per_s": tok_s, "target_ms": 1000 / tok_s, "settings": {**base, **settings}}


def test_like_takes_the_fastest_bf16_row_with_target_labels(tmp_path, monkeypatch):
    path = _table(tmp_path / "t.json", [
        _row("baseline", 100.0), _row("packed-compiled", 150.0, target_forward="packed", target_compile=True),
        _row("fp8-compiled", 300.0, target_forward="packed", target_compile=True, fp8_target=True),
        _row("data-labels", 400.0, labels="data"), {"name": "hf-cudnn", "error": "RuntimeError: no kernel",
                                                     "settings": _row("x", 1.0)["settings"]}])
    assert best_bf16_settings(path)["target_compile"] and not best_bf16_settings(path)["fp8_target"]
    seen = []
    monkeypatch.setattr(bench, "measure", lambda args, peak=None: seen.append(args))
    run(BenchConfig(**TINY, like=path, out=str(tmp_path / "o.json")))
    assert seen[0].target_forward == "packed" and seen[0].target_compile and seen[0].like is None
    with pytest.raises(ConfigError, match="no measured bf16 row"):
        best_bf16_settings(_table(tmp_path / "u.json", [_row("fp8", 9.0, fp8_target=True)]))


def test_fastest_sdpa_and_a_failed_row_in_the_table():
    rows = [_row("packed", 100.0), _row("packed-cudnn", 120.0, sdpa_backend="cudnn"),
            _row("hf-flash", 500.0, sdpa_backend="flash")]
    assert bench._fastest_sdpa(rows) == "cudnn"  # among the packed rows only
    assert bench._fastest_sdpa([]) == "auto"
    text = format_lever_table({"preset": "tiny", "device": "cpu", "rows": [
        {**rows[0], "step_ms": 1.0, "target_wait_ms": 0.0, "drafter_ms": 1.0, "peak_mem_gib": None, "wall_s": 1.0},
        {"name": "packed-cudnn", "error": "RuntimeError: No viable backend", "wall_s": 0.5}]})
    assert "| packed | 100 | 1.000x |" in text and "| packed-cudnn | failed: RuntimeError" in text


def test_bad_lever_settings_are_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown levers"):
        BenchConfig(levers="baseline,warp-drive")
    with pytest.raises(ValueError, match="with --levers"):
        BenchConfig(sdpa_backend="best")
    with pytest.raises(ConfigError, match="--append"):
        path = tmp_path / "other.json"
        path.write_text(json.dumps({"preset": "qwen3-8b", "rows": []}))
        run(BenchConfig(**TINY, levers="baseline", append=True, out=str(path)))
    with pytest.raises(ConfigError, match="target.forward: packed"):
        load_config(TrainConfig, None, {"target.compile": "true", "target.forward": "hf"})
    with pytest.raises(ConfigError, match="attn_implementation"):
        load_config(TrainConfig, None, {"target.sdpa_backend": "flash", "target.attn_implementation": "eager",
                                        "target.forward": "hf"})
    with pytest.raises(ConfigError, match="overlap_target"):
        load_config(TrainConfig, None, {"pipeline.overlap_target": "true", "pipeline.layout": "split",
                                        "pipeline.target_ranks": "1", "pipeline.drafter_ranks": "1"})


@pytest.mark.parametrize("content, message", [
    ("5", "not a lever table"),
    ('{"rows": 5}', "not a lever table"),
    ('{"rows": [3]}', "not a lever table"),
    ('{"rows": [{"settings": 1}]}', "not a lever table"),
    ('{"preset": "tiny", "tokens_per_s": 1000.0}', "not a lever table"),  # a one-setting result, not a table
    (json.dumps({"rows": [_row("x", 10.0, warp=True)]}), r"hold \['warp'\], not lever fields"),
    (json.dumps({"rows": [_row("x", 10.0, target_forward=5)]}), "target_forward"),
])
def test_like_with_a_file_that_is_not_a_lever_table_is_named(tmp_path, monkeypatch, content, message):
    (tmp_path / "t.json").write_text(content)
    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("measured before --like was checked"))
    with pytest.raises(ConfigError, match=f"--like {tmp_path / 't.json'}: .*{message}"):
        run(BenchConfig(**TINY, like=str(tmp_path / "t.json"), out=str(tmp_path / "o.json")))


def test_an_out_that_cannot_be_written_fails_before_measuring(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "measure", lambda *a, **k: pytest.fail("measured before --out was checked"))
    with pytest.raises(OutputError, match=f"--out {tmp_path} is a directory; give a file name"):
        run(BenchConfig(**TINY, out=str(tmp_path)))
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(OutputError, match="a_file is a file, not a directory"):
        run(BenchConfig(**TINY, levers="baseline", out=str(tmp_path / "a_file" / "levers.json")))
