"""One config system and one error policy for every job (cli.py, utils/config.py)."""

from __future__ import annotations

import errno
import importlib
import logging
import sys
from dataclasses import dataclass, field

import pytest
import yaml

import dflash_train.cli as cli_mod
from dflash_train.cli import JOBS, main
from dflash_train.utils.config import cli, leaf_fields, load_config
from dflash_train.utils.config_cli import normalize_argv
from dflash_train.utils.errors import ConfigError, DataError


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_field_of_every_job_has_a_help_line(job):
    config = importlib.import_module(JOBS[job][0]).CONFIG
    missing = [leaf.name for leaf in leaf_fields(config) if not leaf.help]
    assert not missing, f"{job}: fields without a help line: {missing}"


@pytest.mark.parametrize("job", sorted(JOBS))
def test_every_job_answers_help(job, capsys):
    with pytest.raises(SystemExit) as exc:
        main([job, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--config FILE" in out and "--print-config" in out and "--debug" in out


def _train(*options: str) -> list[str]:
    return ["train", "--data.path", "d", *options, "--print-config"]


def test_resolved_config_from_options(capsys):
    assert main(_train("--optim.lr", "3e-4", "--run.max_steps", "2e3", "--run.compile", "--no-run.tensorboard",
                       "--drafter.target_layer_ids", "1,3,5", "--run.progress", "false")) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["optim"]["lr"] == 3e-4 and cfg["run"]["max_steps"] == 2000
    assert cfg["run"]["compile"] is True and cfg["run"]["tensorboard"] is False and cfg["run"]["progress"] is False
    assert cfg["drafter"]["target_layer_ids"] == [1, 3, 5]


def test_train_print_config_needs_no_dataset_but_a_run_does(capsys):
    assert main(["train", "--print-config"]) == 0  # a newcomer sees the defaults first
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["data"]["path"] == "" and cfg["optim"]["lr"] > 0
    assert main(["train"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dflash-train train: error: data.path is required: a dataset directory written by `dflash-train prepare` "
        "(--data.path DIR)")


def test_init_from_target_options(capsys):
    assert main(_train("--drafter.init_from_target", "layers", "--drafter.init_target_layers", "25", "26", "27", "28",
                       "29")) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["drafter"]["init_from_target"] == "layers" and cfg["drafter"]["init_target_layers"] == [25, 26, 27, 28, 29]
    assert main(_train("--drafter.init_from_target", "spread")) == 0
    assert yaml.safe_load(capsys.readouterr().out)["drafter"]["init_from_target"] == "spread"
    assert main(_train()) == 0
    assert yaml.safe_load(capsys.readouterr().out)["drafter"]["init_from_target"] == "none"


@pytest.mark.parametrize("options, message", [
    (["--optim.lr", "-1e-3"], "optim.lr must be > 0"),  # a negative number is a value, not an option
    (["--optim.lr", "nan"], "optim.lr: expected a finite number"),
    (["--run.epochs", "inf"], "run.epochs: expected a finite number"),
    (["--step.noise_sigma", "nan"], "step.noise_sigma: expected a finite number"),
    (["--run.max_steps", "1.5e0"], "run.max_steps: expected an integer"),
    (["--optim.eps", "-1"], "optim.eps must be > 0"),
    (["--optim.weight_decay", "-0.1"], "optim.weight_decay >= 0"),
    (["--step.attention", "fast"], "step.attention: 'fast' is not one of ['auto', 'flex', 'dense']"),
    (["--run.compile=maybe"], "run.compile: expected true/false or 'auto', got 'maybe'"),
    (["--run.compile_autotune", "--no-run.compile"], "run.compile_autotune needs run.compile: true"),
    (["--optim.decay_fraction", "5", "--optim.schedule", "wsd"], "optim.decay_fraction must be in (0, 1], got 5.0"),
    (["--optim.decay_fraction", "0.5"], "optim.decay_fraction (0.5) applies to optim.schedule wsd; optim.schedule is"),
    (["--loss.dpace_alpha", "0.3"], "loss.dpace_alpha (0.3) applies to loss.weighting dpace; loss.weighting is 'decay'"),
    (["--drafter.markov_head", "gated"], "drafter.markov_head ('gated') applies to drafter.variant dspark; "
                                         "drafter.variant is 'dflash'"),
    (["--drafter.markov_rank", "64"], "drafter.markov_rank (64) applies to drafter.variant dspark"),
    (["--drafter.init_from_target", "first"], "drafter.init_from_target: 'first' is not one of"),
    (["--drafter.init_target_layers", "1,2"], "drafter.init_target_layers ([1, 2]) applies to drafter.init_from_target layers"),
    (["--drafter.init_from_target", "layers", "--drafter.init_target_layers", "1,2"], "one target layer id per drafter layer (5), got 2"),
])
def test_bad_values_are_one_line_errors_before_anything_loads(options, message, capsys):
    assert main(_train(*options)) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_abbreviated_and_unknown_options_are_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        main(_train("--optim.warm", "7"))
    assert exc.value.code == 2 and "unrecognized arguments: --optim.warm" in capsys.readouterr().err


@pytest.mark.parametrize("argv, hint", [
    (["train", "--data.path", "d", "--optim.lrr", "1"], "(did you mean --optim.lr?)"),
    (["train", "--data.path", "d", "--run.max_step", "2"], "(did you mean --run.max_steps?)"),
    (["prepare", "in.jsonl", "--ouptut", "o"], "(did you mean --output?)"),
    (["eval", "--drafter", "d", "--num-promtps=3"], "(did you mean --num-prompts?)"),
])
def test_a_mistyped_option_names_the_closest_one(argv, hint, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and hint in err and len(err.strip().splitlines()) == 2  # usage + the error


def test_an_unknown_option_far_from_every_option_gets_no_guess(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--data.path", "d", "--zzzzzz", "1"])
    assert "unrecognized arguments: --zzzzzz 1" in (err := capsys.readouterr().err) and "did you mean" not in err


def test_unknown_key_in_a_config_file_names_the_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lrr: 1e-3\n")
    assert main(["train", "--config", str(path), "--data.path", "d"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "optim.lrr" in err and "valid keys under optim" in err


def test_a_section_given_twice_in_a_config_file_is_an_error(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  lr: 1.0e-3\nrun:\n  max_steps: 3\noptim:\n  warmup_steps: 5\n")
    assert main(["train", "--config", str(path), "--data.path", "d", "--print-config"]) == 2
    err = capsys.readouterr().err
    assert f"{path}: line 5: 'optim' is given twice in one mapping (first on line 1)" in err
    path.write_text(  # a merge key's values may still be overridden
        "optim:\n  <<: {lr: 1.0e-3, warmup_steps: 2}\n  warmup_steps: 7\n")
    assert main(["train", "--config", str(path), "--data.path", "d", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["optim"]["warmup_steps"] == 7


@pytest.mark.parametrize("text, want", [
    ("data: [unclosed\n  x: 1\n", ":2:4: not valid YAML: expected ',' or ']', but got ':' (while parsing a flow sequence)"),
    ("a: 1\n\tb: 2\n", ":2:1: not valid YAML: found character '\\t' that cannot start any token"),
    (b"\xff\xfe", ": not valid YAML: 'utf-8' codec can't decode byte 0xff in position 0"),
])
def test_a_config_that_is_not_yaml_is_one_line_with_its_place(text, want, tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["prepare", "in.jsonl", "-o", str(tmp_path / "out"), "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path}{want}" in err


@dataclass
class _Flags:
    inputs: list[str] = field(default_factory=list, metadata=cli(positional=True))
    """files"""
    skip_bad_rows: bool = False
    """skip"""
    output: str = field(default="", metadata=cli(aliases=("-o",)))
    """out"""
    lr: float = 1.0
    """rate"""


def test_flags_values_positionals_and_aliases():
    norm = normalize_argv(["--skip-bad-rows", "a.jsonl", "-o", "x", "--lr", "-2", "b.jsonl"], _Flags)
    assert norm == ["--skip-bad-rows=true", "a.jsonl", "-o", "x", "--lr=-2", "b.jsonl"]
    assert normalize_argv(["--no-skip-bad-rows", "--skip_bad_rows", "false"], _Flags) == [
        "--skip-bad-rows=false", "--skip_bad_rows=false"]
    parser = cli_mod.argparse.ArgumentParser(allow_abbrev=False)
    cli_mod.add_config_arguments(parser, _Flags)
    args = parser.parse_intermixed_args(norm)
    cfg = cli_mod.config_from_args(_Flags, args)
    assert cfg == _Flags(inputs=["a.jsonl", "b.jsonl"], skip_bad_rows=True, output="x", lr=-2.0)


def test_integers_are_exact():
    @dataclass
    class C:
        n: int = 0
        """n"""

    assert load_config(C, None, {"n": "12345678901234567890"}).n == 12345678901234567890
    assert load_config(C, None, {"n": "2e3"}).n == 2000
    for bad in ("1.5", "1e-1", "true", "nan"):
        with pytest.raises(ConfigError, match="expected an integer"):
            load_config(C, None, {"n": bad})


def test_a_bug_keeps_its_traceback_and_debug_shows_user_errors_too(monkeypatch, capsys, caplog):
    module = importlib.import_module(JOBS["export"][0])

    def buggy(cfg, args):
        raise KeyError("a bug")

    monkeypatch.setattr(module, "run", buggy)
    with pytest.raises(KeyError):  # not a DFlashError: not turned into a one-line error
        main(["export", "src", "-o", "out"])

    def user_error(cfg, args):
        raise DataError("rows.jsonl", 3, "messages", "is empty")

    monkeypatch.setattr(module, "run", user_error)
    assert main(["export", "src", "-o", "out"]) == 2
    assert capsys.readouterr().err.strip() == "dflash-train export: error: rows.jsonl:3: field 'messages' is empty"
    with caplog.at_level(logging.ERROR, logger="dflash_train"):
        logging.getLogger("dflash_train").propagate = True
        try:
            assert main(["export", "src", "-o", "out", "--debug"]) == 2
        finally:
            logging.getLogger("dflash_train").propagate = False
    assert any(r.exc_info and "is empty" in str(r.exc_info[1]) for r in caplog.records)


@pytest.mark.parametrize("job, argv", [
    ("prepare", ["in.jsonl", "-o", "out/data"]), ("generate", ["--synthesize", "2", "--output", "out/gen.jsonl"]),
    ("export", ["run", "-o", "out/drafter"]), ("prompts", ["--output", "out/prompts"]), ("demo", ["-o", "out/demo"]),
])
def test_a_full_disk_or_read_only_output_is_one_line_naming_the_path(job, argv, monkeypatch, capsys):
    module = importlib.import_module(JOBS[job][0])
    full = OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(module, "run", lambda cfg, args: (_ for _ in ()).throw(full))
    assert main([job, *argv]) == 2  # a write() that fails carries no file name: the job's output is named
    out = argv[argv.index("-o" if "-o" in argv else "--output") + 1]
    assert capsys.readouterr().err.strip() == (f"dflash-train {job}: error: {out}: No space left on device: "
                                               f"free some space there or choose another output")
    monkeypatch.setattr(module, "run", lambda cfg, args: (_ for _ in ()).throw(
        OSError(errno.EROFS, "Read-only file system", "/mnt/ro/shard-00000.arrow")))
    assert main([job, *argv]) == 2
    assert capsys.readouterr().err.strip() == (f"dflash-train {job}: error: /mnt/ro/shard-00000.arrow: Read-only "
                                               f"file system: choose an output on a writable filesystem")
    for err, text, fix in [(errno.EFBIG, "File too large", "raise the file-size limit (ulimit -f) or choose "
                            "another output"),
                           (errno.ENOTDIR, "Not a directory", "a file stands where the output needs a folder: "
                            "choose another output"),
                           (errno.EEXIST, "File exists", "a file stands where the output needs a folder: choose "
                            "another output")]:
        monkeypatch.setattr(module, "run", lambda cfg, args, e=err, t=text: (_ for _ in ()).throw(OSError(e, t, "x/f")))
        assert main([job, *argv]) == 2
        assert capsys.readouterr().err.strip() == f"dflash-train {job}: error: x/f: {text}: {fix}"
    monkeypatch.setattr(module, "run", lambda cfg, args: (_ for _ in ()).throw(FileNotFoundError(errno.ENOENT, "gone")))
    with pytest.raises(FileNotFoundError):  # any other OSError is a bug: it keeps its traceback
        main([job, *argv])


def test_broken_pipe_is_quiet(monkeypatch, capsys):
    module = importlib.import_module(JOBS["export"][0])

    def pipe(cfg, args):
        raise BrokenPipeError

    monkeypatch.setattr(module, "run", pipe)
    redirected = []
    monkeypatch.setattr(sys.stdout, "fileno", lambda: 1, raising=False)
    monkeypatch.setattr(cli_mod.os, "dup2", lambda src, dst: redirected.append(dst))
    assert main(["export", "src", "-o", "out"]) == 0  # `dflash-train ... | head`: quiet, stdout to /dev/null
    assert redirected == [1] and "Traceback" not in capsys.readouterr().err


def test_a_list_option_given_twice_keeps_both(capsys):
    """`--set A=1 --set B=2` (how the device scripts combine overrides) must not drop the first."""
    assert main(["bench", "--set", "run.compile_autotune=true", "--set", "optim.compiled_step=false",
                 "loss.chunk_rows=64", "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["set"] == ["run.compile_autotune=true", "optim.compiled_step=false", "loss.chunk_rows=64"]


def test_auto_or_a_value_options_take_every_spelling(capsys):
    """`bool | auto` and `int | auto` fields: auto by default, a bare flag, --no-flag, `--flag auto`, a
    number; anything else is one line naming what the field takes."""
    assert main(_train()) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert (cfg["run"]["compile"], cfg["run"]["drafter_dtype"], cfg["target"]["forward"], cfg["target"]["compile"]) \
        == ("auto", "auto", "auto", "auto")
    spellings = ((["--run.compile"], True), (["--no-run.compile"], False), (["--run.compile", "auto"], "auto"),
                 (["--run.compile", "false", "--optim.lr", "1e-3"], False))
    for options, compiled in spellings:
        assert main(_train(*options)) == 0
        assert yaml.safe_load(capsys.readouterr().out)["run"]["compile"] == compiled, options
    gen = ["generate", "--prompts", "p.jsonl", "--output", "o.jsonl", "--print-config"]
    assert main(gen) == 0 and yaml.safe_load(capsys.readouterr().out)["batch_size"] == "auto"
    assert main([*gen, "--batch-size", "48"]) == 0 and yaml.safe_load(capsys.readouterr().out)["batch_size"] == 48
    assert main([*gen, "--batch-size", "many"]) == 2
    assert capsys.readouterr().err.strip() == \
        "dflash-train generate: error: batch_size: expected an integer or 'auto', got 'many'"
    assert main([*gen, "--batch-size", "0"]) == 2
    assert "batch_size must be >= 1 or auto, got 0" in capsys.readouterr().err


def test_a_config_path_that_is_no_file_says_what_it_is(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone.yaml")
    for path, what in [("run", "a folder, not a file (a run's saved config is {w}/run/config.yaml)"),
                       ("loop-a", "a loop of symbolic links"),
                       ("dangling", "a symbolic link to '{w}/gone.yaml', which does not exist")]:
        assert main(_train("--config", str(tmp_path / path))) == 2
        assert capsys.readouterr().err.strip() == \
            f"dflash-train train: error: config file {tmp_path / path}: {what.format(w=tmp_path)}"
    assert main(_train("--config", str(tmp_path / "none.yaml"))) == 2
    assert capsys.readouterr().err.strip().endswith(f"config file not found: {tmp_path / 'none.yaml'}")
    assert main(["prepare", str(tmp_path / "loop-a"), "-o", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip() == f"dflash-train prepare: error: input {tmp_path / 'loop-a'}: a loop of " \
                                              f"symbolic links"


def test_a_runs_saved_config_is_a_valid_config_file(tmp_path, capsys):
    """What a run writes to config.yaml (its options plus what it resolved) reads back as --config."""
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump({"optim": {"lr": 0.002}, "drafter_resolved": {"mask_token_id": 3},
                                     "data_resolved": {"train_samples": 10}}))
    assert main(_train("--config", str(saved))) == 0
    printed = capsys.readouterr()
    assert yaml.safe_load(printed.out)["optim"]["lr"] == 0.002
    assert f"{saved}: a run's saved config; its record of what the run resolved (drafter_resolved, " \
           f"data_resolved) is left out" in printed.err
    saved.write_text("drafter_resolvd: {}\n")  # a typo is still refused
    assert main(_train("--config", str(saved))) == 2
    assert "unknown config key(s) drafter_resolvd" in capsys.readouterr().err
