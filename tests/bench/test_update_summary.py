"""bench/results/update_summary.py: the registry's commands name only paths that exist."""

import json

import pytest

from .scripts import load_script

update_summary = load_script("bench/results/update_summary.py")


def test_every_registry_command_names_existing_paths():
    data = json.loads(update_summary.PATH.read_text())
    assert data and update_summary.check(data) == []
    # the check looks at real paths: each command names at least one script or raw result
    assert [k for k, e in data.items() if not update_summary.named_paths(e["command"])] == []


def test_named_paths_reads_paths_out_of_prose():
    cmd = ("ROWS=autotune bash dev/device/drafter_step.sh 2>/dev/null  # raw: bench/results/x/ (a.json), "
           "configs/a.yaml, python tools/probe.py, then bash .ci/run; not drafter/row_stats.py nor "
           "/tmp/bench/out.json nor mybench/x nor my.ci/run nor /dev/shm/x")
    assert update_summary.named_paths(cmd) == ["dev/device/drafter_step.sh", "bench/results/x/", "configs/a.yaml",
                                               "tools/probe.py", ".ci/run"]


def test_missing_paths_and_globs(tmp_path):
    (tmp_path / "bench" / "device").mkdir(parents=True)
    (tmp_path / "bench" / "device" / "a.sh").write_text("")
    (tmp_path / "bench" / "r1-x.json").write_text("")
    cmd = "bash bench/device/a.sh; bash bench/device/b.sh  # raw: bench/r*-x.json, bench/q*.json"
    assert update_summary.missing_paths(cmd, tmp_path) == ["bench/device/b.sh", "bench/q*.json"]


@pytest.fixture
def registry(tmp_path, monkeypatch):
    (tmp_path / "dev" / "device").mkdir(parents=True)
    (tmp_path / "dev" / "device" / "a.sh").write_text("")
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"k.old": {"value": 1.0, "device": "d", "date": "2026-01-01",
                                          "command": "bash dev/device/a.sh"}}))
    monkeypatch.setattr(update_summary, "PATH", path)
    monkeypatch.setattr(update_summary, "ROOT", tmp_path)
    return path


def test_a_command_naming_a_missing_script_is_refused_and_nothing_written(registry, capsys):
    before = registry.read_text()
    rc = update_summary.main(["k.new", "2.5", "H200", "bash dev/device/gone.sh"])
    assert rc == 2 and registry.read_text() == before
    assert "key k.new: command names dev/device/gone.sh, which does not exist" in capsys.readouterr().err


def test_a_good_command_is_written_beside_the_old_keys(registry):
    assert update_summary.main(["k.new", "2.5", "H200", "bash dev/device/a.sh  # raw: dev/device/a.sh"]) == 0
    data = json.loads(registry.read_text())
    assert list(data) == ["k.new", "k.old"] and data["k.new"]["value"] == 2.5
    assert data["k.new"]["command"].startswith("bash dev/device/a.sh")


def test_check_names_each_bad_key(registry, capsys):
    assert update_summary.main(["--check"]) == 0
    data = json.loads(registry.read_text())
    data["k.bad"] = {"value": 1.0, "device": "d", "date": "x", "command": "bash scripts/none.sh"}
    registry.write_text(json.dumps(data))
    assert update_summary.main(["--check"]) == 2
    assert "key k.bad: command names scripts/none.sh" in capsys.readouterr().err


def test_every_result_folder_is_named_by_a_registry_command():
    # bench/results holds the registry's raw results only; other runs' folders live in dev/results
    data = json.loads(update_summary.PATH.read_text())
    named = {p.split("/")[2] for e in data.values() for p in update_summary.named_paths(e["command"])
             if p.startswith("bench/results/") and p.count("/") >= 2}
    folders = {d.name for d in update_summary.PATH.parent.iterdir() if d.is_dir() and d.name != "__pycache__"}
    assert folders and sorted(folders - named) == []
