"""The README's command blocks work as written.

Every ```bash block of README.md is run, command after command, in a fresh folder (beside a
link to the checkout's `src/`, so the paths the README names resolve), with the tests' tiny
target in place of `builtin`. A block marked `<!-- readme-test: check-only (why) -->` on the
line before it is parsed instead: each command must take every option it is given (its job
resolves the config, as `--print-config` does), and each step must read only what an earlier
step of the block writes (dataset, run, drafter). `<!-- readme-test: skip (why) -->` leaves a
block out; the reason is required.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from dflash_train.cli import main

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[a-z-]+) \((?P<why>[^)]+)\) -->\n)?```bash\n(?P<body>.*?)```", re.S)
# options that name the target model; `builtin` there becomes the tiny target
TARGET_OPTIONS = {"--target", "--target.path"}


def readme_blocks(text: str) -> list[tuple[str, list[list[str]]]]:
    """(mark, commands) of every bash block; a command is its argv after `dflash-train` (or
    `torchrun ... -m dflash_train`). Any other command is an error unless the block is skipped."""
    out = []
    for m in BLOCK.finditer(text):
        mark = m["mark"] or "run"
        assert mark in ("run", "check-only", "skip"), f"unknown readme-test mark {mark!r}"
        if mark == "skip":
            continue
        body = re.sub(r"\\\n", " ", m["body"])  # continuation lines
        commands = []
        for line in body.splitlines():
            line = line.split(" #")[0].strip()
            if not line or line.startswith("#"):
                continue
            argv = shlex.split(line)
            if argv[0] == "torchrun":
                argv = argv[argv.index("dflash_train") + 1:]
            else:
                assert argv[0] == "dflash-train", f"the README test cannot run {line!r}: mark its block"
                argv = argv[1:]
            commands.append(argv)
        out.append((mark, commands))
    return out


def _tiny(argv: list[str], target: str) -> list[str]:
    return [target if i and argv[i - 1] in TARGET_OPTIONS and a == "builtin" else a for i, a in enumerate(argv)]


def _resolved(argv: list[str], capsys) -> dict:
    assert main([*argv, "--print-config"]) == 0, f"dflash-train {' '.join(argv)}: {capsys.readouterr().err}"
    return yaml.safe_load(capsys.readouterr().out)


def _reads(job: str, cfg: dict, *, after_a_step: bool) -> list[str]:
    """What a step reads that an earlier step must write (prepare's inputs: when a step came before)."""
    if job == "prepare":
        return cfg["inputs"] if after_a_step else []
    return {"train": lambda: [cfg["data"]["path"]], "export": lambda: [cfg["source"]],
            "eval": lambda: [cfg["drafter"]]}.get(job, list)()


def check_chain(commands: list[list[str]], capsys) -> None:
    """Every command parses, and each step reads what an earlier one writes."""
    written: set[str] = set()
    for argv in commands:
        job, cfg = argv[0], _resolved(argv, capsys)
        for path in _reads(job, cfg, after_a_step=bool(written)):
            assert path in written, f"dflash-train {' '.join(argv)} reads {path}, which no earlier step writes"
        written.add(cfg["run"]["output_dir"] if job == "train" else cfg.get("output"))


def test_readme_blocks_are_found_and_marked() -> None:
    blocks = readme_blocks((ROOT / "README.md").read_text())
    assert [mark for mark, _ in blocks] == ["run", "check-only"]
    assert [c[0] for c in blocks[0][1]] == ["generate", "prepare", "train", "export", "eval"]


def test_a_wrong_command_fails_the_check(capsys) -> None:
    good = [["prepare", "gen.jsonl", "--output", "data/x"], ["train", "--data.path", "data/x",
                                                                 "--run.output_dir", "runs/x"],
            ["export", "runs/x", "--output", "d"]]
    check_chain(good, capsys)
    with pytest.raises(AssertionError, match="reads runs/y, which no earlier step writes"):
        check_chain([*good[:2], ["export", "runs/y", "--output", "d"]], capsys)
    with pytest.raises(SystemExit):  # an unknown option
        check_chain([["export", "runs/x", "--outptu", "d"]], capsys)


def test_the_check_only_blocks_parse_and_chain(capsys) -> None:
    for mark, commands in readme_blocks((ROOT / "README.md").read_text()):
        if mark == "check-only":
            check_chain(commands, capsys)


def test_the_readme_commands_run_as_written(tiny_targets, tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "src").symlink_to(ROOT / "src")  # the paths the README names, from the checkout
    monkeypatch.chdir(tmp_path)
    for mark, commands in readme_blocks((ROOT / "README.md").read_text()):
        if mark != "run":
            continue
        check_chain(commands, capsys)
        for argv in commands:
            argv = _tiny(argv, str(tiny_targets["llama"]))
            rc = main(argv)
            assert rc == 0, f"dflash-train {' '.join(argv)} exited {rc}: {capsys.readouterr().err[-2000:]}"
    assert (tmp_path / "drafters" / "mine" / "model.safetensors").is_file()
    assert list((tmp_path / "runs" / "eval").glob("*/report.json"))
