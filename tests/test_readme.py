"""The README's command blocks work as pasted.

Every ```bash block of README.md is run by `bash -e` in a fresh folder that holds links to the
checkout's `src/`, `configs/` and `.venv/` (what a fresh clone after `scripts/setup.sh` has), with
a PATH that holds no virtual environment (`/usr/bin:/bin`, as a new shell has), so a bare
`dflash-train` fails there as it fails for a newcomer. The tests' tiny target replaces `builtin`
after `--target` / `--target.path`. A block marked `<!-- readme-test: check-only (why) -->` on the
line before it is parsed instead: each command must take every option it is given (its job
resolves the config, as `--print-config` does), and each step must read only what an earlier step
of the block writes (dataset, run, drafter). `<!-- readme-test: skip (why) -->` leaves a block
out; the reason is required.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_train.cli import main

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(?:<!-- readme-test: (?P<mark>[a-z-]+) \((?P<why>[^)]+)\) -->\n)?```bash\n(?P<body>.*?)```", re.S)
# options that name the target model; `builtin` there becomes the tiny target
TARGET = re.compile(r"(--target(?:\.path)?)(\s+|=)builtin\b")
CLEAN_PATH = "/usr/bin:/bin"  # a new shell's PATH: no virtual environment on it


def blocks(text: str) -> list[tuple[str, str]]:
    """(mark, body) of every bash block; mark is run, check-only or skip."""
    out = []
    for m in BLOCK.finditer(text):
        mark = m["mark"] or "run"
        assert mark in ("run", "check-only", "skip"), f"unknown readme-test mark {mark!r}"
        out.append((mark, m["body"]))
    return out


def commands(body: str) -> list[list[str]]:
    """The argv of every command of a block after the program (`.venv/bin/dflash-train`, or
    `.venv/bin/torchrun ... -m dflash_train`); any other command is an error (mark the block)."""
    out = []
    for line in re.sub(r"\\\n", " ", body).splitlines():
        line = line.split(" #")[0].strip()
        if not line or line.startswith("#"):
            continue
        argv = shlex.split(line)
        if Path(argv[0]).name == "torchrun":
            argv = argv[argv.index("dflash_train") + 1:]
        else:
            assert Path(argv[0]).name == "dflash-train", f"the README test cannot run {line!r}: mark its block"
            argv = argv[1:]
        out.append(argv)
    return out


def readme_blocks(text: str) -> list[tuple[str, list[list[str]]]]:
    """(mark, commands) of every block that is not skipped."""
    return [(mark, commands(body)) for mark, body in blocks(text) if mark != "skip"]


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


def fresh_clone(where: Path) -> Path:
    """A folder laid out as a fresh clone after scripts/setup.sh: the checkout's src/, configs/, .venv/.
    Run from that .venv (the README's test command), a missing `dflash-train` there fails; run by
    another interpreter (a GPU host's own torch), a checkout without setup.sh's .venv skips."""
    if not (ROOT / ".venv" / "bin" / "dflash-train").is_file():
        if Path(sys.prefix).resolve() == (ROOT / ".venv").resolve():
            pytest.fail("the .venv running the tests has no bin/dflash-train: scripts/setup.sh did not install it")
        pytest.skip("no .venv/bin/dflash-train in this checkout: the README's commands need scripts/setup.sh's "
                    "environment (the README's test command runs the suite from it)")
    where.mkdir()
    for name in ("src", "configs", ".venv"):
        (where / name).symlink_to(ROOT / name)
    return where


def run_block(body: str, where: Path, target: Path) -> subprocess.CompletedProcess:
    """The block as pasted into a new shell (`bash -e`, no virtual environment on the PATH)."""
    script = TARGET.sub(lambda m: f"{m[1]}{m[2]}{shlex.quote(str(target))}", body)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    env.update(PATH=CLEAN_PATH, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(["bash", "-e", "-c", script], cwd=where, env=env, capture_output=True, text=True,
                          timeout=1800)


def test_readme_blocks_are_found_and_marked() -> None:
    found = readme_blocks((ROOT / "README.md").read_text())
    assert [mark for mark, _ in found] == ["run", "check-only"]
    assert [c[0] for c in found[0][1]] == ["generate", "prepare", "train", "export", "eval"]


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
    for mark, found in readme_blocks((ROOT / "README.md").read_text()):
        if mark == "check-only":
            check_chain(found, capsys)


def test_a_bare_dflash_train_fails_in_a_new_shell(tmp_path) -> None:
    """What the test's shell has on its PATH: no `dflash-train` (the README must not rely on one)."""
    done = run_block("dflash-train --version\n", fresh_clone(tmp_path / "clone"), tmp_path)
    assert done.returncode == 127 and "dflash-train: command not found" in done.stderr
    done = run_block(".venv/bin/dflash-train --version\n", tmp_path / "clone", tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("dflash-train ")


@pytest.mark.slow
def test_the_readme_commands_run_as_pasted(tiny_targets, tmp_path, capsys) -> None:
    clone = fresh_clone(tmp_path / "clone")
    for mark, body in blocks((ROOT / "README.md").read_text()):
        if mark != "run":
            continue
        check_chain(commands(body), capsys)
        done = run_block(body, clone, tiny_targets["llama"])
        assert done.returncode == 0, f"the README block exited {done.returncode}:\n{done.stderr[-3000:]}"
    assert (clone / "drafters" / "mine" / "model.safetensors").is_file()
    assert list((clone / "runs" / "eval").glob("*/report.json"))
