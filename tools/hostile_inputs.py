"""Hostile inputs across every job: what a user, a full disk or a killed process gives the tool.

    python tools/hostile_inputs.py --out /tmp/hostile [--jobs 3] [--only train]

Builds a tiny random target (tests/conftest.py), a dataset, a short run and its drafter, then
runs each case as its own `dflash-train` process and classifies what happened:

    OK      exit 2 with one line naming what is wrong (the file, row or field asked for), or
            success where the input is valid
    WEAK    a traceback or an unclear message, but nothing lost
    DEFECT  a hang, a wrong exit 0, a changed or deleted user file, temp files left behind

It prints the table and the counts, writes them to OUT/report.md and OUT/report.json, and
exits 1 when any case is a DEFECT. A full disk is simulated with RLIMIT_FSIZE (writes past the
limit fail with EFBIG, as a full disk fails with ENOSPC); read-only places need a non-root user.
`scripts/recipe_data.sh` is probed the same way, each case in a scratch git repository that
keeps the fixture's drafter (its one line starts `recipe_data: `).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

# The child: an optional file-size limit (the disk-full stand-in), then the CLI.
CHILD = textwrap.dedent("""
    import os, resource, signal, sys
    limit = os.environ.get("PROBE_FSIZE")
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), resource.RLIM_INFINITY))
    from dflash_train.cli import main
    sys.exit(main(sys.argv[1:]))
""")
# The child of a SIGTERM that lands while export writes the weights.
SIGTERM_CHILD = textwrap.dedent("""
    import os, signal, sys
    import dflash_train.drafter.checkpoint as checkpoint
    real = checkpoint.save
    def save(*args, **kwargs):
        data = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return data
    checkpoint.save = save
    from dflash_train.cli import main
    sys.exit(main(sys.argv[1:]))
""")
RECIPE_DATA = ROOT / "scripts" / "recipe_data.sh"
LEFTOVER = re.compile(r"(^\..+\.(tmp|old)-\d+@)|(\.tmp$)|(^\.write-test-)|(^\..+\.(restore|old)-[A-Za-z0-9]{6}$)")


@dataclass
class Case:
    name: str
    job: str
    argv: list[str] | Callable[[Path], list[str]]
    expect: str = "error"  # "error": exit 2 with one line; "ok": exit 0
    names: tuple[str, ...] = ()  # what the one line must name
    protect: Callable[[Path], list[Path]] | None = None  # files that must come out unchanged
    check: Callable[[Path, "Result"], str | None] | None = None  # a DEFECT message, or None
    fsize: int | None = None
    kind: str = "plain"  # plain | twice | group-sigint | sigterm-mid-write | script (recipe_data.sh)
    timeout: float = 180.0
    note: str = ""
    known: str = ""  # a known weak point worked on elsewhere: a wrong exit 0 here loses nothing, so it is WEAK
    cwd: Callable[[Path], Path] | None = None  # where it runs (default: the case's folder)
    expect_rc: int | None = None  # an exit status other than 2 (error) or 0 (ok) that is the right one


@dataclass
class Result:
    rc: int | None
    out: str
    err: str
    seconds: float
    verdict: str = ""
    why: str = ""
    extra: dict = field(default_factory=dict)


# -- fixtures ----------------------------------------------------------------------------------------


def build_fixtures(root: Path) -> dict[str, Path]:
    fx = root / "fixtures"
    if (fx / "ready").is_file():
        return json.loads((fx / "ready").read_text(), object_hook=lambda d: {k: Path(v) for k, v in d.items()})
    return _build_fixtures(fx)


def _build_fixtures(fx: Path) -> dict[str, Path]:
    from tests.conftest import build_target, build_tokenizer, prepare_dataset, synthetic_conversations

    shutil.rmtree(fx, ignore_errors=True)
    fx.mkdir(parents=True)
    target = fx / "target"
    tok = build_tokenizer(target)
    build_target(target, "llama", vocab=len(tok))
    rows = synthetic_conversations(160)
    data = prepare_dataset(target, rows, fx / "data")
    prompts = fx / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": r["messages"][0]["content"]}) + "\n" for r in rows[:3]))
    chats = fx / "chats.jsonl"  # generate reads conversations and writes the target's own answers to them
    chats.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    run = fx / "run"
    _cli(["train", *train_args(target, data, run)], check=True)
    drafter = fx / "drafter"
    _cli(["export", str(run), "-o", str(drafter)], check=True)
    paths = {"target": target, "data": data, "prompts": prompts, "run": run, "drafter": drafter, "rows": fx / "data.jsonl",
             "chats": chats}
    (fx / "ready").write_text(json.dumps({k: str(v) for k, v in paths.items()}))
    return paths


def train_args(target: Path, data: Path, out: Path, steps: int = 2) -> list[str]:
    return ["--target.path", str(target), "--data.path", str(data), "--run.output_dir", str(out), "--run.device", "cpu",
            "--run.max_steps", str(steps), "--run.save_every", "2", "--no-run.progress", "--no-run.tensorboard",
            "--data.plan.token_budget", "512", "--drafter.num_layers", "1", "--drafter.block_size", "4",
            "--step.num_anchors", "8", "--eval.spec_prompts", "null"]


def _env(fsize: int | None = None) -> dict:
    # RECIPE_CURRENT_DRAFTER empty: a scratch repository keeps its own drafters, restore-drafter gives its newest
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1", "RECIPE_CURRENT_DRAFTER": ""}
    env.pop("PROBE_FSIZE", None)
    if fsize:
        env["PROBE_FSIZE"] = str(fsize)
    return env


def _cli(argv: list[str], *, check: bool = False, cwd: Path | None = None, fsize: int | None = None,
         timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, cwd=cwd,
                          env=_env(fsize), timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"fixture step failed: dflash-train {' '.join(argv)}\n{proc.stderr[-3000:]}")
    return proc


# -- running and classifying ----------------------------------------------------------------------------


def _digest(paths: list[Path]) -> dict[str, str | None]:
    out = {}
    for p in paths:
        if p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
        elif p.is_dir():
            out[str(p)] = hashlib.sha256("\n".join(sorted(
                f"{q.relative_to(p)}:{hashlib.sha256(q.read_bytes()).hexdigest() if q.is_file() else 'dir'}"
                for q in p.rglob("*") if q.name != ".dflash-train.lock")).encode()).hexdigest()
        else:
            out[str(p)] = None
    return out


def _leftovers(where: Path) -> list[str]:
    return [str(p.relative_to(where)) for p in where.rglob("*") if LEFTOVER.search(p.name)]


def run_case(case: Case, root: Path) -> Result:
    where = root / "cases" / re.sub(r"[^A-Za-z0-9_.-]", "_", case.name)
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    try:  # a case whose own setup fails is reported as that case's DEFECT; the other cases still run
        argv = case.argv(where) if callable(case.argv) else list(case.argv)
        protected = case.protect(where) if case.protect else []
    except Exception as exc:  # noqa: BLE001 - any setup error, named in the report
        detail = (getattr(exc, "stderr", None) or b"")
        detail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
        return Result(None, "", detail, 0.0, verdict="DEFECT",
                      why=f"the case's setup failed: {type(exc).__name__}: {exc} {detail.strip()[-300:]}".strip())
    before = _digest(protected)
    t0 = time.perf_counter()
    if case.kind == "twice":
        result = _run_twice(argv, where, case)
    elif case.kind == "group-sigint":
        result = _run_group_sigint(argv, where, case)
    else:
        command = {"script": ["bash", str(RECIPE_DATA)], "sigterm-mid-write": [sys.executable, "-c", SIGTERM_CHILD]
                   }.get(case.kind, [sys.executable, "-c", CHILD])
        env = _env(case.fsize)
        if case.kind == "script":  # git looks no further up than the case's folder (the probe may run in a clone)
            env["GIT_CEILING_DIRECTORIES"] = str(where.parent)
        try:
            proc = subprocess.run([*command, *argv], capture_output=True, text=True,
                                  cwd=case.cwd(where) if case.cwd else where, env=env, timeout=case.timeout)
            result = Result(proc.returncode, proc.stdout, proc.stderr, 0.0,
                            extra={"expect_rc": case.expect_rc} if case.expect_rc is not None else {})
        except subprocess.TimeoutExpired as exc:
            result = Result(None, str(exc.stdout or ""), str(exc.stderr or ""), 0.0)
    result.seconds = time.perf_counter() - t0
    classify(case, result, where, before, _digest(protected))
    return result


def _run_twice(argv: list[str], where: Path, case: Case) -> Result:
    """The same command started twice, 1 s apart: the second must be refused."""
    first = subprocess.Popen([sys.executable, "-c", CHILD, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=where, env=_env())
    time.sleep(1.0)
    second = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, cwd=where,
                            env=_env(), timeout=case.timeout)
    try:
        out, err = first.communicate(timeout=case.timeout)
    except subprocess.TimeoutExpired:
        first.kill()
        out, err = first.communicate()
        return Result(None, out, err, 0.0)
    if first.returncode == 2 and second.returncode == 0:  # the second start took the folder first
        return Result(first.returncode, out, err, 0.0, extra={"other_rc": second.returncode})
    res = Result(second.returncode, second.stdout, second.stderr, 0.0, extra={"other_rc": first.returncode})
    if first.returncode != 0:
        res.extra["other_err"] = err[-500:]
    return res


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _run_group_sigint(argv: list[str], where: Path, case: Case) -> Result:
    """SIGINT to the whole process group once the workers run (Ctrl-C, `timeout`)."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=where, env=_env(), start_new_session=True)
    deadline = time.monotonic() + 120
    while len(_children(proc.pid)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=30)
        return Result(proc.returncode, out, err, 0.0, extra={"expect_rc": 130})
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return Result(None, out, err, 0.0)


def classify(case: Case, r: Result, where: Path, before: dict, after: dict) -> None:
    defects = []
    if r.rc is None:
        defects.append(f"hang: no exit within {case.timeout:.0f}s")
    changed = [Path(p).name for p in before if before[p] != after[p]]
    if changed:
        defects.append(f"user file changed or lost: {', '.join(changed)}")
    left = _leftovers(where)
    if left and r.rc is not None:
        defects.append(f"leftover temp files: {', '.join(left[:3])}")
    if case.check is not None and r.rc is not None:
        msg = case.check(where, r)
        if msg:
            defects.append(msg)
    err_lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    last = err_lines[-1] if err_lines else ""
    prefix = "recipe_data: " if case.kind == "script" else f"dflash-train {case.job}: error:"
    one_line = last.startswith(prefix) and "Traceback" not in r.err
    expect_rc = r.extra.get("expect_rc", 2 if case.expect == "error" else 0)
    if case.expect == "error" and r.rc == 0:
        if case.known and not defects:
            r.verdict, r.why = "WEAK", f"accepted with exit 0: {case.known}"
            return
        defects.append("wrong exit 0 for a bad input")
    if defects:
        r.verdict, r.why = "DEFECT", "; ".join(defects)
    elif r.rc == expect_rc and case.expect == "ok":
        r.verdict, r.why = "OK", "success"
    elif r.rc == expect_rc and expect_rc in (130, 143):
        r.verdict, r.why = ("OK", last[:150]) if "Traceback" not in r.err and last else \
            ("WEAK", "traceback or no word on the interrupt")
    elif r.rc == 2 and one_line:
        missing = [n for n in case.names if n not in last]
        r.verdict, r.why = ("OK", last[:150]) if not missing else ("WEAK", f"does not name {missing}: {last[:150]}")
        if case.expect == "ok":
            r.verdict, r.why = "WEAK", f"a valid input refused: {last[:150]}"
    elif "Traceback" in r.err:
        exc = next((ln for ln in reversed(err_lines) if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", ln)), last)
        r.verdict, r.why = "WEAK", f"traceback (rc {r.rc}): {exc[:150]}"
    else:
        r.verdict, r.why = "WEAK", f"rc {r.rc}: {last[:150]}"


# -- the cases ----------------------------------------------------------------------------------------


def _write(path: Path, text: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def _rows(n: int = 20) -> str:
    from tests.conftest import synthetic_conversations

    return "".join(json.dumps(r) + "\n" for r in synthetic_conversations(n))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    return dst


def _metrics_steps_unique(where: Path, r: Result) -> str | None:
    path = where / "run" / "metrics.jsonl"
    if not path.is_file():
        return None
    steps = [json.loads(ln)["step"] for ln in path.read_text().splitlines() if ln.strip() and '"train"' in ln]
    if len(steps) != len(set(steps)):
        return f"steps recorded twice in metrics.jsonl: {steps}"
    if r.extra.get("other_rc") not in (0, None):
        return f"the run that held the folder failed: {r.extra.get('other_err', '')[-200:]}"
    return None


def prepare_cases(fx: dict) -> list[Case]:
    T = ["--target", str(fx["target"]), "--no-progress"]
    good = _rows()

    def p(name, files: dict, extra=(), expect="error", names=(), protect=None, inputs=None, out="out", **kw):
        def argv(w: Path) -> list[str]:
            for rel, text in files.items():
                _write(w / rel, text)
            given = inputs if inputs is not None else [rel for rel in files if not rel.startswith("_") and
                                                       not rel.startswith("out")] or ["missing.jsonl"]
            return ["prepare", *[str(w / i) for i in given], "-o", str(w / out), *T,
                    *[a.replace("{w}", str(w)) for a in extra]]
        return Case(f"prepare/{name}", "prepare", argv, expect, names, protect, **kw)

    bad = lambda line: good + line + "\n"  # noqa: E731
    return [
        p("valid rows", {"rows.jsonl": good}, expect="ok"),
        p("byte order mark", {"rows.jsonl": "\ufeff" + good}, expect="ok"),
        p("missing input", {}, names=("missing.jsonl",)),
        p("empty file", {"rows.jsonl": ""}, names=("no row was kept",)),
        p("csv file", {"rows.csv": "prompt,response\na,b\n"}, names=("rows.csv",)),
        p("invalid JSON line", {"rows.jsonl": bad('{"prompt": "a",,}')}, names=("rows.jsonl:21",)),
        p("torn last line", {"rows.jsonl": good + '{"prompt": "a", "resp'}, names=("rows.jsonl:21",)),
        p("not UTF-8", {"rows.jsonl": good.encode() + b'{"prompt": "caf\xe9", "response": "x"}\n'}, names=("rows.jsonl:21",)),
        p("prompt is a number", {"rows.jsonl": bad('{"prompt": 3, "response": "x"}')}, names=("rows.jsonl:21", "prompt")),
        p("messages not a list", {"rows.jsonl": bad('{"messages": "hi"}')}, names=("rows.jsonl:21", "messages")),
        p("bad role", {"rows.jsonl": bad('{"messages": [{"role": "wizard", "content": "x"}]}')}, names=("role",)),
        p("content missing", {"rows.jsonl": bad('{"messages": [{"role": "user"}]}')}, names=("content",)),
        p("row is a list", {"rows.jsonl": bad("[1, 2]")}, names=("rows.jsonl:21",)),
        p("row is null", {"rows.jsonl": bad("null")}, names=("rows.jsonl:21",)),
        p("no assistant turn", {"rows.jsonl": '{"messages": [{"role": "user", "content": "hi"}]}\n'},
          names=("rows.jsonl:1", "no assistant turn")),
        p("skip bad rows", {"rows.jsonl": bad('{"prompt": 3}')}, ["--skip-bad-rows"], expect="ok"),
        p("json object not list", {"rows.json": '{"prompt": "a", "response": "b"}'}, expect="ok",
          note="a single object is one row"),
        p("json broken", {"rows.json": '[{"prompt": "a", "response": "b"},\n oops]'}, names=("rows.json:2",)),
        p("corrupt parquet", {"rows.parquet": b"PAR1 not parquet"}, names=("rows.parquet",)),
        p("empty directory input", {"_d/.keep": ""}, inputs=["_d"], names=("_d",)),
        p("output exists", {"rows.jsonl": good, "out/mine.txt": "keep"}, names=("out", "--overwrite"),
          protect=lambda w: [w / "out" / "mine.txt"]),
        p("overwrite a foreign dir", {"rows.jsonl": good, "out/mine.txt": "keep"}, ["--overwrite"], names=("out",),
          protect=lambda w: [w / "out" / "mine.txt"]),
        p("output is a file", {"rows.jsonl": good, "out": "my file"}, names=("out",), protect=lambda w: [w / "out"]),
        p("output is the input", {"rows.jsonl": good}, out="rows.jsonl", names=("rows.jsonl",),
          protect=lambda w: [w / "rows.jsonl"]),
        p("output inside input dir", {"in/rows.jsonl": good}, inputs=["in"], out="in/out", expect="ok",
          protect=lambda w: [w / "in" / "rows.jsonl"],
          note="accepted: a later prepare of the folder skips the dataset in it (tests/test_bad_inputs.py)"),
        p("max length 1", {"rows.jsonl": good}, ["--max-length", "1"], names=("max_length",)),
        p("workers -1", {"rows.jsonl": good}, ["--workers", "-1"], names=("workers",)),
        p("shard size 0", {"rows.jsonl": good}, ["--shard-size", "0"], names=("shard_size",)),
        p("overflow bad choice", {"rows.jsonl": good}, ["--overflow", "cut"], names=("cut",)),
        p("target missing", {"rows.jsonl": good}, ["--target", "{w}/nope"], names=("nope",)),
        p("target is a text file", {"rows.jsonl": good, "_t.txt": "x"}, ["--target", "{w}/_t.txt"], names=("_t.txt",)),
        p("chat template missing", {"rows.jsonl": good}, ["--chat-template", "{w}/none.jinja"], names=("none.jinja",)),
        p("chat template broken", {"rows.jsonl": good, "_t.jinja": "{% for m in messages %}{{ m.content }"},
          ["--chat-template", "{w}/_t.jinja"], names=("_t.jinja",)),
        p("disk full", {"rows.jsonl": _rows(160)}, fsize=20_000, names=("out",)),
        p("output below a file", {"rows.jsonl": good, "_f": "x"}, ["-o", "{w}/_f/out"], names=("_f",)),
        p("config not YAML", {"rows.jsonl": good, "_c.yaml": "a: [1,\n"}, ["--config", "{w}/_c.yaml"], names=("_c.yaml",)),
        p("config not a mapping", {"rows.jsonl": good, "_c.yaml": "- 1\n"}, ["--config", "{w}/_c.yaml"],
          names=("_c.yaml",)),
        p("config wrong type", {"rows.jsonl": good, "_c.yaml": "max_length: lots\n"}, ["--config", "{w}/_c.yaml"],
          names=("max_length",)),
        p("config unknown key", {"rows.jsonl": good, "_c.yaml": "max_lenght: 5\n"}, ["--config", "{w}/_c.yaml"],
          names=("max_lenght",)),
        p("config missing", {"rows.jsonl": good}, ["--config", "{w}/none.yaml"], names=("none.yaml",)),
        p("config section twice", {"rows.jsonl": good, "_c.yaml": "max_length: 10\nmax_length: 20\n"},
          ["--config", "{w}/_c.yaml"], names=("max_length",), known="a key given twice in YAML"),
        Case("prepare/SIGINT to the group", "prepare", lambda w: [
            "prepare", str(_write(w / "big.jsonl", _big_rows())), "-o", str(w / "out"), *T, "--workers", "2"],
            kind="group-sigint"),
    ]


def _big_rows(n: int = 4000) -> str:
    import random

    from tests.conftest import WORDS
    rng = random.Random(0)
    return "".join(json.dumps({"prompt": " ".join(rng.choices(WORDS, k=300)),
                               "response": " ".join(rng.choices(WORDS, k=300))}) + "\n" for _ in range(n))


def train_cases(fx: dict) -> list[Case]:
    target, data = fx["target"], fx["data"]

    def t(name, extra=(), expect="error", names=(), setup=None, protect=None, **kw):
        def argv(w: Path) -> list[str]:
            if setup:
                setup(w)
            return ["train", *train_args(target, data, w / "run"), *[a.replace("{w}", str(w)) for a in extra]]
        return Case(f"train/{name}", "train", argv, expect, names, protect, **kw)

    def trained(w: Path) -> None:
        _copy(fx["run"], w / "run")

    def torn(w: Path) -> None:
        trained(w)
        with (w / "run" / "metrics.jsonl").open("a") as fh:
            fh.write('{"step": 9, "kind": "train", "loss": 6.1')

    def junk_metrics(w: Path) -> None:
        _write(w / "run" / "metrics.jsonl", "hello\nworld\n")
        _write(w / "run" / "config.yaml", "# mine\nrun: {seed: 1}\n")

    def user_config(w: Path) -> None:
        _write(w / "config.yaml", f"# my config\ntarget: {{path: {target}}}\ndata: {{path: {data}}}\n"
                                  f"run: {{device: cpu, max_steps: 1, progress: false, tensorboard: false}}\n")

    def torn_ckpt(w: Path) -> None:
        trained(w)
        for f in (w / "run" / "checkpoints").rglob("model.safetensors"):
            f.write_bytes(f.read_bytes()[:100])

    def bad_manifest(w: Path) -> None:
        _copy(data, w / "data")
        (w / "data" / "manifest.json").write_text('{"format_version": 1, "shards": [')

    def no_shard(w: Path) -> None:
        _copy(data, w / "data")
        next((w / "data").glob("shard-*.arrow")).unlink()

    def cut_shard(w: Path) -> None:
        _copy(data, w / "data")
        s = next((w / "data").glob("shard-*.arrow"))
        s.write_bytes(s.read_bytes()[: s.stat().st_size // 2])

    wdata = ["--data.path", "{w}/data"]
    return [
        t("valid run", expect="ok"),
        t("resume a finished run", ["--resume", "--run.max_steps", "4"], expect="ok", setup=trained),
        t("fresh start over checkpoints", setup=trained, names=("--resume",), protect=lambda w: [w / "run" / "checkpoints"]),
        t("resume with nothing", ["--resume"], names=("--resume",)),
        t("torn metrics line, resume", ["--resume", "--run.max_steps", "4"], expect="ok", setup=torn),
        t("junk metrics, fresh", setup=junk_metrics, names=("metrics.jsonl",),
          protect=lambda w: [w / "run" / "config.yaml", w / "run" / "metrics.jsonl"]),
        Case("train/user config in the run folder", "train", lambda w: (user_config(w), [
            "train", "--config", str(w / "config.yaml"), "--run.output_dir", "."])[1], names=("config.yaml",),
            protect=lambda w: [w / "config.yaml"]),
        Case("train/started twice", "train", lambda w: ["train", *train_args(target, data, w / "run", steps=6)],
             kind="twice", names=("in use",), check=_metrics_steps_unique),
        t("torn checkpoint, resume", ["--resume"], setup=torn_ckpt, names=("checkpoint",),
          protect=lambda w: [w / "run" / "checkpoints"]),
        t("corrupt manifest", wdata, setup=bad_manifest, names=("manifest.json",)),
        t("missing shard", wdata, setup=no_shard, names=("shard-00000.arrow",)),
        t("truncated shard", wdata, setup=cut_shard, names=("shard-00000.arrow",)),
        t("data path missing", ["--data.path", "{w}/none"], names=("none",)),
        t("data is a jsonl file", ["--data.path", str(fx["rows"])], names=("data.jsonl",)),
        t("target missing", ["--target.path", "{w}/none"], names=("none",)),
        t("lr negative", ["--optim.lr", "-1"], names=("lr",)),
        t("lr is text", ["--optim.lr", "fast"], names=("lr",)),
        t("lr is nan", ["--optim.lr", "nan"], names=("lr",)),
        t("max steps 1.5", ["--run.max_steps", "1.5"], names=("max_steps",)),
        t("block size 0", ["--drafter.block_size", "0"], names=("block_size",)),
        t("token budget 1", ["--data.plan.token_budget", "1"], names=("token_budget",)),
        t("unknown device", ["--run.device", "tpu"], names=("tpu",)),
        t("cuda without a GPU", ["--run.device", "cuda"], names=("cuda",)),
        t("split without torchrun", ["--pipeline.layout", "split"], names=("split",)),
        t("output below a file", ["--run.output_dir", "{w}/f/run"], setup=lambda w: _write(w / "f", "x"), names=("f",)),
        t("disk full", ["--run.max_steps", "2"], fsize=60_000, names=("run",)),
        t("eval prompts missing", ["--eval.spec_prompts", "{w}/none.jsonl"], names=("none.jsonl",)),
        t("init_from missing", ["--drafter.init_from", "{w}/none"], names=("none",)),
        t("config wrong type", ["--config", "{w}/c.yaml"], names=("optim",),
          setup=lambda w: _write(w / "c.yaml", "optim: 5\n")),
        t("config unknown section", ["--config", "{w}/c.yaml"], names=("optimiser",),
          setup=lambda w: _write(w / "c.yaml", "optimiser: {lr: 1}\n")),
        t("config list for a number", ["--config", "{w}/c.yaml"], names=("lr",),
          setup=lambda w: _write(w / "c.yaml", "optim: {lr: [1, 2]}\n")),
        t("config empty file", ["--config", "{w}/c.yaml"], expect="ok", setup=lambda w: _write(w / "c.yaml", "")),
        t("config section twice", ["--config", "{w}/c.yaml"], names=("optim",),
          setup=lambda w: _write(w / "c.yaml", "optim: {lr: 0.1}\noptim: {warmup_steps: 1}\n"),
          known="a YAML section given twice"),
        t("resume value bad", ["--resume", "yes"], names=("--resume",)),
        t("mistyped flag", ["--optim.lrr", "1"], names=("--optim.lrr",)),
    ]


def export_cases(fx: dict) -> list[Case]:
    def e(name, argv, expect="error", names=(), setup=None, protect=None, **kw):
        def build(w: Path) -> list[str]:
            if setup:
                setup(w)
            return ["export", *[a.replace("{w}", str(w)) for a in argv]]
        return Case(f"export/{name}", "export", build, expect, names, protect, **kw)

    run = str(fx["run"])
    return [
        e("valid", [run, "-o", "{w}/out"], expect="ok"),
        e("source missing", ["{w}/none", "-o", "{w}/out"], names=("none",)),
        e("source not a run", ["{w}/d", "-o", "{w}/out"], names=("d",), setup=lambda w: _write(w / "d" / "x.txt", "x")),
        e("output exists", [run, "-o", "{w}/out"], names=("--overwrite",), setup=lambda w: _write(w / "out" / "m", "k"),
          protect=lambda w: [w / "out"]),
        e("overwrite foreign", [run, "-o", "{w}/out", "--overwrite"], names=("out",),
          setup=lambda w: _write(w / "out" / "m", "k"), protect=lambda w: [w / "out"]),
        e("output is a file", [run, "-o", "{w}/out"], names=("out",), setup=lambda w: _write(w / "out", "k"),
          protect=lambda w: [w / "out"]),
        e("output is the source", ["{w}/run", "-o", "{w}/run", "--overwrite"], names=("run",),
          setup=lambda w: _copy(fx["run"], w / "run"), protect=lambda w: [w / "run" / "checkpoints"]),
        e("torn checkpoint", ["{w}/run", "-o", "{w}/out"], names=("checkpoint",), setup=lambda w: [
            _copy(fx["run"], w / "run"), shutil.rmtree(w / "run" / "final"),
            *[f.write_bytes(b"x") for f in (w / "run" / "checkpoints").rglob("model.safetensors")]]),
        e("bad dtype", [run, "-o", "{w}/out", "--dtype", "int8"], names=("int8",)),
        e("disk full", [run, "-o", "{w}/out"], fsize=20_000, names=("out",)),
        e("output below a file", [run, "-o", "{w}/f/out"], names=("f",), setup=lambda w: _write(w / "f", "x")),
        e("drafter dir as source", [str(fx["drafter"]), "-o", "{w}/out"], expect="ok"),
    ]


def eval_cases(fx: dict) -> list[Case]:
    base = ["--target", str(fx["target"]), "--no-progress", "--max-new-tokens", "8", "--device", "cpu",
            "--prompts", str(fx["prompts"])]

    def v(name, extra, expect="error", names=(), setup=None, protect=None, drafter=None, **kw):
        def build(w: Path) -> list[str]:
            if setup:
                setup(w)
            d = drafter.replace("{w}", str(w)) if drafter else str(fx["drafter"])
            return ["eval", "--drafter", d, *base, *[a.replace("{w}", str(w)) for a in extra]]
        return Case(f"eval/{name}", "eval", build, expect, names, protect, **kw)

    return [
        v("valid", ["-o", "{w}/rep"], expect="ok"),
        v("drafter missing", ["-o", "{w}/rep"], drafter="{w}/none", names=("none",)),
        v("drafter config broken", ["-o", "{w}/rep"], drafter="{w}/d", names=("config.json",),
          setup=lambda w: (_copy(fx["drafter"], w / "d"), (w / "d" / "config.json").write_text("{"))),
        v("drafter weights cut", ["-o", "{w}/rep"], drafter="{w}/d", names=("model.safetensors",),
          setup=lambda w: (_copy(fx["drafter"], w / "d"), (w / "d" / "model.safetensors").write_bytes(b"12345678"))),
        v("output is a file", ["-o", "{w}/rep"], names=("rep",), setup=lambda w: _write(w / "rep", "notes"),
          protect=lambda w: [w / "rep"]),
        v("output below a file", ["-o", "{w}/f/rep"], names=("f",), setup=lambda w: _write(w / "f", "x")),
        v("prompts missing", ["-o", "{w}/rep", "--prompts", "{w}/none.jsonl"], names=("none.jsonl",)),
        v("prompts bad row", ["-o", "{w}/rep", "--prompts", "{w}/p.jsonl"], names=("p.jsonl:1",),
          setup=lambda w: _write(w / "p.jsonl", '{"prompt": 7}\n')),
        v("prompts empty", ["-o", "{w}/rep", "--prompts", "{w}/p.jsonl"], names=("p.jsonl",),
          setup=lambda w: _write(w / "p.jsonl", "")),
        v("max new tokens 0", ["--max-new-tokens", "0"], names=("max_new_tokens",)),
        v("num prompts -1", ["--num-prompts", "-1"], names=("num_prompts",)),
        v("target missing", ["--target", "{w}/none"], names=("none",)),
        v("disk full", ["-o", "{w}/rep"], fsize=2_000, names=("rep",)),
        v("report folder exists", ["-o", "{w}/rep"], setup=lambda w: _write(w / "rep" / "mine.txt", "keep"),
          protect=lambda w: [w / "rep" / "mine.txt"], names=("--overwrite",),
          known="an existing report folder is replaced without --overwrite"),
    ]


def bench_cases(fx: dict) -> list[Case]:
    tiny = ["--preset", "tiny", "--tokens", "256", "--doc-len", "40-120", "--anchors", "8", "--block", "4",
            "--layers", "1", "--warmup", "1", "--measure", "1", "--device", "cpu"]

    def b(name, extra, expect="error", names=(), setup=None, protect=None, **kw):
        def build(w: Path) -> list[str]:
            if setup:
                setup(w)
            return ["bench", *tiny, *[a.replace("{w}", str(w)) for a in extra]]
        return Case(f"bench/{name}", "bench", build, expect, names, protect, **kw)

    return [
        b("valid", ["--out", "{w}/b.json"], expect="ok"),
        b("out is a directory", ["--out", "{w}/d"], names=("--out",), setup=lambda w: (w / "d").mkdir()),
        b("out below a file", ["--out", "{w}/f/b.json"], names=("f",), setup=lambda w: _write(w / "f", "x")),
        b("like an int table", ["--like", "{w}/t.json", "--out", "{w}/b.json"], names=("--like",),
          setup=lambda w: _write(w / "t.json", '{"rows": 5}')),
        b("like a list", ["--like", "{w}/t.json", "--out", "{w}/b.json"], names=("--like",),
          setup=lambda w: _write(w / "t.json", "[1]")),
        b("like missing", ["--like", "{w}/none.json", "--out", "{w}/b.json"], names=("none.json",)),
        b("like not JSON", ["--like", "{w}/t.json", "--out", "{w}/b.json"], names=("--like",),
          setup=lambda w: _write(w / "t.json", "{")),
        b("measure not a multiple", ["--warmup", "2", "--measure", "3"], names=("--measure",)),
        b("unknown lever", ["--levers", "warp"], names=("warp",)),
        b("unknown preset", ["--preset", "gpt-9"], names=("gpt-9",)),
        b("set without =", ["--set", "optim.lr"], names=("--set",)),
        b("set unknown key", ["--set", "optim.lrr=1", "--out", "{w}/b.json"], names=("lrr",)),
        b("append other preset", ["--levers", "baseline", "--append", "--out", "{w}/t.json"], names=("--append",),
          setup=lambda w: _write(w / "t.json", json.dumps({"preset": "qwen3-8b", "rows": []})),
          protect=lambda w: [w / "t.json"]),
    ]


def other_cases(fx: dict) -> list[Case]:
    gen = ["--target", str(fx["target"]), "--device", "cpu", "--max-new-tokens", "4", "--no-progress"]

    def g(name, extra, expect="error", names=(), setup=None, protect=None, **kw):
        def build(w: Path) -> list[str]:
            if setup:
                setup(w)
            return ["generate", *gen, *[a.replace("{w}", str(w)) for a in extra]]
        return Case(f"generate/{name}", "generate", build, expect, names, protect, **kw)

    def pr(name, extra, expect="error", names=(), setup=None, protect=None, **kw):
        def build(w: Path) -> list[str]:
            if setup:
                setup(w)
            return ["prompts", *[a.replace("{w}", str(w)) for a in extra]]
        return Case(f"prompts/{name}", "prompts", build, expect, names, protect, **kw)

    def dm(name, extra, names=(), **kw):  # --quick: a demo that does not stop at a bad option still ends
        return Case(f"demo/{name}", "demo", lambda w: ["demo", "-o", str(w / "demo"), "--device", "cpu", "--quick",
                                                       *extra], "error", names, timeout=420, **kw)

    P = str(fx["chats"])
    return [
        g("valid", ["--prompts", P, "--output", "{w}/o.jsonl"], expect="ok"),
        g("prompts missing", ["--prompts", "{w}/none.jsonl", "--output", "{w}/o.jsonl"], names=("none.jsonl",)),
        g("prompts bad row", ["--prompts", "{w}/p.jsonl", "--output", "{w}/o.jsonl"], names=("p.jsonl:1",),
          setup=lambda w: _write(w / "p.jsonl", '{"prompt": [1]}\n')),
        g("prompts empty", ["--prompts", "{w}/p.jsonl", "--output", "{w}/o.jsonl"], names=("p.jsonl",),
          setup=lambda w: _write(w / "p.jsonl", ""), known="an empty prompts file writes 0 rows"),
        g("output is a directory", ["--prompts", P, "--output", "{w}/d"], names=("d",), setup=lambda w: (w / "d").mkdir()),
        g("output holds other rows", ["--prompts", P, "--output", "{w}/o.jsonl"], names=("o.jsonl",),
          setup=lambda w: _write(w / "o.jsonl", "my notes, not JSON\n"), protect=lambda w: [w / "o.jsonl"]),
        g("output torn last line", ["--prompts", P, "--output", "{w}/o.jsonl"], expect="ok",
          setup=lambda w: _write(w / "o.jsonl", '{"messages": [{"role": "user", "con')),
        g("disk full", ["--prompts", P, "--output", "{w}/o.jsonl"], fsize=200, names=("o.jsonl",)),
        g("output below a file", ["--prompts", P, "--output", "{w}/f/o.jsonl"], names=("f",),
          setup=lambda w: _write(w / "f", "x")),
        g("temperature negative", ["--prompts", P, "--output", "{w}/o.jsonl", "--temperature", "-1"],
          names=("temperature",)),
        g("target missing", ["--prompts", P, "--output", "{w}/o.jsonl", "--target", "{w}/none"], names=("none",)),
        g("http without url", ["--prompts", P, "--output", "{w}/o.jsonl", "--engine", "http"], names=("base_url",)),
        pr("unknown source", ["--sources", "nowhere", "-o", "{w}/p"], names=("nowhere",)),
        pr("humaneval file missing", ["--sources", "math", "--humaneval-file", "{w}/none.jsonl.gz", "-o", "{w}/p",
                                      "--limit", "5"], names=("none.jsonl.gz",),
           note="a FileNotFoundError traceback is the other part of the work"),
        pr("output is a file", ["--sources", "math", "--limit", "5", "-o", "{w}/p"], names=("p",),
           setup=lambda w: _write(w / "p", "mine"), protect=lambda w: [w / "p"]),
        pr("limit negative", ["--sources", "math", "--limit", "-5", "-o", "{w}/p"], names=("limit",)),
        pr("stdlib missing", ["--sources", "stdlib-code", "--stdlib", "{w}/none", "-o", "{w}/p", "--limit", "5"],
           names=("none",)),
        pr("disk full", ["--sources", "math", "--limit", "50", "-o", "{w}/p"], fsize=300, names=("p",)),
        dm("train minutes negative", ["--train-minutes", "-1"], names=("--train-minutes",),
           note="found late is the other part of the work"),
        dm("eval prompts negative", ["--eval-prompts", "-1"], names=("--eval-prompts",)),
        Case("demo/output is a file", "demo", lambda w: (_write(w / "demo", "mine"),
             ["demo", "-o", str(w / "demo"), "--device", "cpu", "--quick"])[1], names=("demo",),
             protect=lambda w: [w / "demo"]),
        dm("threads negative", ["--threads", "-2"], names=("threads",)),
    ]


LONE_SURROGATE = '{"messages": [{"role": "user", "content": "hi \\ud83d"}, {"role": "assistant", "content": "ok"}]}\n'


def _absent(*names: str) -> Callable[[Path, Result], str | None]:
    """A check: none of `names` (relative to the case folder) exists afterwards."""
    def check(w: Path, r: Result) -> str | None:
        left = [n for n in names if (w / n).exists() or (w / n).is_symlink()]
        return f"left behind: {', '.join(left)}" if left else None
    return check


def _edited_drafter(fx: dict, w: Path) -> Path:
    """The fixture's drafter with a config.json that does not describe its weights."""
    d = _copy(fx["drafter"], w / "d")
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] *= 2
    (d / "config.json").write_text(json.dumps(config))
    return d


def input_cases(fx: dict) -> list[Case]:
    """Inputs a newcomer hands over: text that is no Unicode, sizes past any machine, settings that would be
    ignored, files edited by hand, paths that lead nowhere."""
    tiny = ["--target", str(fx["target"])]
    gen = ["generate", *tiny, "--device", "cpu", "--max-new-tokens", "4", "--no-progress"]
    ev = ["eval", *tiny, "--device", "cpu", "--no-progress", "--max-new-tokens", "4", "--prompts", str(fx["prompts"])]

    def c(name, job, build, expect="error", names=(), **kw):
        return Case(f"{job}/{name}", job, lambda w: [a.replace("{w}", str(w)) for a in build(w)], expect, names, **kw)

    def trained(w: Path) -> Path:
        return _copy(fx["run"], w / "run")

    def hand_edited(w: Path) -> None:
        trained(w)
        path = w / "run" / "config.yaml"
        path.write_text(path.read_text().replace("lr: 0.0006", "lr: 0.003"))

    def edit_kept(w: Path, r: Result) -> str | None:
        kept = w / "run" / "config.yaml.edited"
        return None if kept.is_file() and "lr: 0.003" in kept.read_text() else "the hand-edited config.yaml was lost"

    return [
        c("lone surrogate", "prepare", lambda w: ["prepare", str(_write(w / "rows.jsonl", LONE_SURROGATE)), "-o",
                                                  "{w}/out", *tiny, "--no-progress"],
          names=("rows.jsonl:1", "surrogate"), check=_absent("out")),
        c("lone surrogate", "generate", lambda w: [*gen, "--prompts", str(_write(w / "p.jsonl", LONE_SURROGATE)),
                                                   "--output", "{w}/o.jsonl"], names=("p.jsonl:1", "surrogate"),
          check=_absent("o.jsonl")),
        c("lone surrogate", "eval", lambda w: [*ev, "--drafter", str(fx["drafter"]), "--prompts",
                                               str(_write(w / "p.jsonl", LONE_SURROGATE)), "-o", "{w}/rep"],
          names=("p.jsonl:1", "surrogate"), check=_absent("rep")),
        c("batch size 1e9", "generate", lambda w: [*gen, "--prompts", str(fx["chats"]), "--output", "{w}/o.jsonl",
                                                   "--batch-size", "1000000000"], names=("--batch-size",),
          check=_absent("o.jsonl")),
        c("existing output, other settings", "generate", lambda w: [
            *gen, "--prompts", str(fx["chats"]), "--output", str(_write(w / "o.jsonl", json.dumps(
                {"id": "r-x", "messages": [], "generator": {"model": "target", "temperature": 0.0, "top_p": 1.0,
                                                            "top_k": 0, "max_new_tokens": 99}}) + "\n"))],
          names=("max_new_tokens", "--append-other-settings"), protect=lambda w: [w / "o.jsonl"]),
        c("fails before any row", "generate", lambda w: [*gen, "--prompts", str(fx["chats"]), "--output",
                                                         "{w}/o.jsonl", "--engine", "http", "--base-url",
                                                         "http://127.0.0.1:9", "--retries", "0"],
          check=lambda w, r: _absent("o.jsonl")(w, r) or ("promises a resume with nothing written"
                                                           if "finished rows are saved" in r.err else None)),
        c("markov rank 2e9", "train", lambda w: ["train", *train_args(fx["target"], fx["data"], w / "run"),
                                                 "--drafter.variant", "dspark", "--drafter.markov_rank", "2000000000"],
          names=("markov_rank",), check=_absent("run")),
        c("decay fraction 5", "train", lambda w: ["train", *train_args(fx["target"], fx["data"], w / "run"),
                                                  "--optim.schedule", "wsd", "--optim.decay_fraction", "5"],
          names=("decay_fraction must be",)),  # not "schedule must be": the schedule is fine
        c("dpace alpha without dpace", "train", lambda w: ["train", *train_args(fx["target"], fx["data"], w / "run"),
                                                           "--loss.dpace_alpha", "0.3"], names=("dpace_alpha",)),
        c("gated head without dspark", "train", lambda w: ["train", *train_args(fx["target"], fx["data"], w / "run"),
                                                           "--drafter.markov_head", "gated"], names=("markov_head",)),
        c("resume over a hand-edited config", "train", lambda w: (hand_edited(w), [
            "train", *train_args(fx["target"], fx["data"], w / "run", steps=4), "--resume"])[1], expect="ok",
          check=edit_kept),
        c("a run's own config as --config", "train", lambda w: (trained(w), [
            "train", "--config", str(w / "run" / "config.yaml"), "--run.output_dir", str(w / "run"), "--resume",
            "--run.max_steps", "4"])[1], expect="ok"),
        c("config is a folder", "train", lambda w: (w.joinpath("cfg").mkdir(), [
            "train", *train_args(fx["target"], fx["data"], w / "run"), "--config", "{w}/cfg"])[1],
          names=("a folder, not a file",)),
        c("symlink loop input", "prepare", lambda w: ((w / "a.jsonl").symlink_to(w / "b.jsonl"),
                                                      (w / "b.jsonl").symlink_to(w / "a.jsonl"),
                                                      ["prepare", "{w}/a.jsonl", "-o", "{w}/out", *tiny])[2],
          names=("a.jsonl", "a loop of symbolic links")),
        c("config disagrees with weights", "eval", lambda w: [*ev, "--drafter", str(_edited_drafter(fx, w)),
                                                              "-o", "{w}/rep"], names=("config.json",)),
        c("config disagrees with weights", "export", lambda w: ["export", str(_edited_drafter(fx, w)), "-o",
                                                                "{w}/out"],
          names=("config.json",), check=_absent("out")),
        c("strict without greedy", "eval", lambda w: [*ev, "--drafter", str(fx["drafter"]), "--strict",
                                                      "--no-greedy", "-o", "{w}/rep"], names=("--strict",)),
        c("every prompt over the limit", "eval", lambda w: [*ev, "--drafter", str(fx["drafter"]),
                                                            "--max-prompt-tokens", "1", "-o", "{w}/rep"],
          names=("--max-prompt-tokens",)),
        c("a source with no prompt", "prompts", lambda w: ["prompts", "--sources", "stdlib-code", "--stdlib",
                                                           str(_write(w / "lib" / "README", "no code") and w / "lib"),
                                                           "-o", "{w}/p"], names=("stdlib-code",), check=_absent("p")),
        Case("export/SIGTERM while writing", "export", lambda w: ["export", str(fx["run"]), "-o", str(w / "out")],
             kind="sigterm-mid-write", expect_rc=143, names=("SIGTERM",), check=_absent("out")),
    ]


def _repo(fx: dict, w: Path) -> Path:
    """A scratch clone of the project's script that keeps the fixture's drafter as `kept`."""
    repo = w / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(RECIPE_DATA, repo / "scripts" / "recipe_data.sh")
    (repo / "README.md").write_text("x\n")
    for args in (["init", "-q"], ["config", "user.email", "probe@example.com"], ["config", "user.name", "probe"],
                 ["add", "-A"], ["commit", "-qm", "init"]):
        subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)
    subprocess.run(["bash", str(RECIPE_DATA), "store-drafter", "kept", str(fx["drafter"])], cwd=repo, check=True,
                   capture_output=True)
    return repo


def _merge_manifest_naming(repo: Path, name: str, fx: dict) -> None:
    """A kept drafter whose manifest names `name` among its files (a commit this script did not write)."""
    import hashlib

    kept = ("config.json", "model.safetensors")
    files = {f: hashlib.sha256((fx["drafter"] / f).read_bytes()).hexdigest() for f in kept}
    files[name] = "0" * 64
    env = {**os.environ, "GIT_INDEX_FILE": str(repo / ".git" / "probe-index")}
    for f, text in [(f, (fx["drafter"] / f).read_bytes()) for f in kept] + [
            ("manifest.json", json.dumps({"name": "bad", "date": "2026-01-01", "bytes": 1, "note": "",
                                          "files": files}).encode())]:
        sha = subprocess.run(["git", "hash-object", "-w", "--stdin"], cwd=repo, input=text, capture_output=True,
                             check=True).stdout.decode().strip()
        subprocess.run(["git", "update-index", "--add", "--cacheinfo", f"100644,{sha},recipe-drafter/bad/{f}"],
                       cwd=repo, env=env, check=True)
    tree = subprocess.run(["git", "write-tree"], cwd=repo, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()
    commit = subprocess.run(["git", "commit-tree", tree, "-m", "recipe drafter: bad"], cwd=repo, capture_output=True,
                            text=True, check=True).stdout.strip()
    subprocess.run(["git", "merge", "-q", "-s", "ours", "--allow-unrelated-histories", "--no-edit", commit], cwd=repo,
                   check=True, capture_output=True)


def recipe_cases(fx: dict) -> list[Case]:
    """scripts/recipe_data.sh: names, destinations and manifests that must never cost the user a file."""
    def r(name, build, expect="error", names=(), **kw):
        return Case(f"recipe_data/{name}", "recipe_data", build, expect, names, kind="script",
                    cwd=lambda w: w / "repo", **kw)

    def restored(folder: str, want: bytes | None = None) -> Callable[[Path, Result], str | None]:
        def check(w: Path, res: Result) -> str | None:
            weights = w / "repo" / folder / "model.safetensors"
            if not weights.is_file():
                return f"exit {res.rc} but nothing restored into {folder}"
            if want is not None and weights.read_bytes() != want:
                return f"{folder} does not hold the drafter restored last"
            return None
        return check

    def own_export(w: Path) -> Path:
        d = _copy(fx["drafter"], w / "repo" / "mine")
        (d / "notes.txt").write_text("mine\n")
        return d

    def second(w: Path) -> None:  # an earlier restore, then another drafter kept
        subprocess.run(["bash", str(RECIPE_DATA), "restore-drafter", "out"], cwd=w / "repo", check=True,
                       capture_output=True, env=_env())
        other = _copy(fx["drafter"], w / "other")
        (other / "model.safetensors").write_bytes(b"another drafter")
        subprocess.run(["bash", str(RECIPE_DATA), "store-drafter", "second", str(other)], cwd=w / "repo", check=True,
                       capture_output=True)

    return [
        r("restore-drafter into ''", lambda w: (_repo(fx, w), ["restore-drafter", ""])[1], names=("DIR",)),
        r("restore-drafter into DIR/", lambda w: (_repo(fx, w), ["restore-drafter", "out/"])[1], expect="ok",
          check=restored("out")),
        r("restore-drafter over an earlier restore, DIR/", lambda w: (_repo(fx, w), second(w),
                                                                     ["restore-drafter", "out/"])[2], expect="ok",
          check=restored("out", b"another drafter")),
        r("restore-drafter onto the user's export", lambda w: (_repo(fx, w), own_export(w),
                                                              ["restore-drafter", "mine"])[2], names=("mine",),
          protect=lambda w: [w / "repo" / "mine"]),
        r("store-drafter, a space in a file name", lambda w: (_repo(fx, w), ["store-drafter", "spaced", str(
            _write(_copy(fx["drafter"], w / "spaced") / "my notes.txt", "x").parent)])[1], names=("my notes.txt",)),
        r("manifest naming ../victim.txt", lambda w: (_repo(fx, w),
                                                      _merge_manifest_naming(w / "repo", "../victim.txt", fx),
                                                      _write(w / "repo" / "victim.txt", "precious\n"),
                                                      ["restore-drafter", "out"])[3], names=("../victim.txt",),
          protect=lambda w: [w / "repo" / "victim.txt"], check=lambda w, res: _absent("repo/out")(w, res)),
        r("rows of a torn last line", lambda w: (_repo(fx, w),
                                                 _write(w / "repo" / "gen.jsonl", '{"id": "a"}\n{"id": "b'),
                                                 ["rows", "gen.jsonl"])[2], names=("gen.jsonl:2", "torn"),
          check=lambda w, res: "printed rows before failing" if res.out else None),
        Case("recipe_data/list outside a repository", "recipe_data", ["list"], names=("git repository",),
             kind="script"),
    ]


def all_cases(fx: dict) -> list[Case]:
    return [*prepare_cases(fx), *train_cases(fx), *export_cases(fx), *eval_cases(fx), *bench_cases(fx),
            *other_cases(fx), *input_cases(fx), *recipe_cases(fx)]


# -- report --------------------------------------------------------------------------------------------


def report(cases: list[Case], results: list[Result]) -> str:
    lines = ["| case | verdict | exit | s | what happened |", "|---|---|---|---|---|"]
    for c, r in zip(cases, results):
        note = f" ({c.note})" if c.note and r.verdict != "OK" else ""
        lines.append(f"| {c.name} | {r.verdict} | {r.rc} | {r.seconds:.0f} | {r.why.replace('|', '/')}{note} |")
    counts = {v: sum(r.verdict == v for r in results) for v in ("OK", "WEAK", "DEFECT")}
    lines.append("")
    lines.append(f"{len(results)} cases: {counts['OK']} OK, {counts['WEAK']} WEAK, {counts['DEFECT']} DEFECT")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="working folder: fixtures, one folder per case, the report")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once")
    ap.add_argument("--only", default="", help="run only the cases whose name contains this")
    args = ap.parse_args()
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fx = build_fixtures(root)
    cases = [c for c in all_cases(fx) if args.only in c.name]
    print(f"fixtures ready in {time.perf_counter() - t0:.0f}s; {len(cases)} cases, {args.jobs} at a time", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda c: run_case(c, root), cases))
    text = report(cases, results)
    print(text)
    (root / "report.md").write_text(text + "\n")
    (root / "report.json").write_text(json.dumps([{"case": c.name, "verdict": r.verdict, "rc": r.rc, "why": r.why,
                                                   "seconds": round(r.seconds, 1), "note": c.note}
                                                  for c, r in zip(cases, results)], indent=1))
    print(f"total {time.perf_counter() - t0:.0f}s; report: {root / 'report.md'}")
    return 1 if any(r.verdict == "DEFECT" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
