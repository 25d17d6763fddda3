"""A training run's folder: one run at a time, a torn metrics line, and files that are not the run's."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from dflash_train.cli import main
from dflash_train.train.trainer import Trainer
from dflash_train.utils.errors import TrainingError
from dflash_train.utils.fs import LOCK, exclusive_directory

from .test_trainer import make_config, read_metrics




def test_a_torn_last_metrics_line_is_dropped_on_resume(tiny_targets, tiny_datasets, tmp_path, caplog):
    out = tmp_path / "run"
    args = (tiny_targets["llama"], tiny_datasets["llama"], out)
    Trainer(make_config(*args, **{"run.max_steps": 4})).fit()
    with (out / "metrics.jsonl").open("a") as fh:  # a disk that filled while step 5 was appended
        fh.write('{"step": 5, "kind": "train", "loss": 6.1')
    with caplog.at_level(logging.WARNING):
        Trainer(make_config(*args, **{"run.max_steps": 6}), resume=True).fit()
    assert "metrics.jsonl:5: dropping a last line cut short" in caplog.text
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in lines)  # every line a record again
    assert sorted(read_metrics(out)) == [1, 2, 3, 4, 5, 6]


def test_a_metrics_file_that_is_not_one_is_refused_before_anything_is_written(tiny_targets, tiny_datasets, tmp_path,
                                                                            refuse_models):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\nnot json\n{"step": 2, "kind": "train"}\n')
    earlier = yaml.safe_dump({"run": {"seed": 7}, "drafter_resolved": {"mask_token_id": 3}})
    (out / "config.yaml").write_text(earlier)
    with pytest.raises(TrainingError, match=r"metrics.jsonl:2: not a metrics record"):
        Trainer(make_config(tiny_targets["llama"], tiny_datasets["llama"], out))
    assert (out / "config.yaml").read_text() == earlier


def test_the_users_config_in_the_run_folder_is_never_replaced(tiny_targets, tiny_datasets, tmp_path, refuse_models,
                                                              capsys, monkeypatch):
    project = tmp_path / "proj"
    project.mkdir()
    mine = textwrap.dedent(f"""\
        # my experiment: keep these comments
        target: {{path: {tiny_targets['llama']}}}
        data: {{path: {tiny_datasets['llama']}}}
        run: {{device: cpu, max_steps: 2, progress: false, tensorboard: false}}
        """)
    (project / "config.yaml").write_text(mine)
    monkeypatch.chdir(project)
    assert main(["train", "--config", "config.yaml", "--run.output_dir", "."]) == 2
    err = capsys.readouterr().err
    assert "config.yaml is not a config a run wrote" in err and "choose another run.output_dir" in err
    assert (project / "config.yaml").read_text() == mine


HOLD = """
import sys, time
from dflash_train.utils.fs import exclusive_directory
with exclusive_directory(sys.argv[1], job="train", option="run.output_dir"):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_run_in_a_folder_in_use_is_refused_naming_the_first(tiny_targets, tiny_datasets, tmp_path,
                                                                   refuse_models, capsys):
    out = tmp_path / "run"
    cfg = ["--target.path", str(tiny_targets["llama"]), "--data.path", str(tiny_datasets["llama"]),
           "--run.output_dir", str(out), "--run.device", "cpu", "--run.max_steps", "1", "--no-run.progress"]
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "held"
        assert main(["train", *cfg]) == 2
        err = capsys.readouterr().err
        assert f"{out} is in use by another dflash-train train (pid {first.pid}@" in err
        assert not (out / "config.yaml").exists()
    finally:
        first.kill()  # SIGKILL: no clean-up code of the holder runs
        first.wait()
    # the kernel dropped the killed holder's lock: the folder is free again (now for a real start)
    with exclusive_directory(out, job="train", option="run.output_dir"):
        assert (out / LOCK).read_text().startswith(f"{os.getpid()}@")
