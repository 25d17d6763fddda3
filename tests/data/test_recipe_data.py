"""scripts/recipe_data.sh: generated conversations kept in history, outside the working tree.

Each test runs the real script in a scratch git repository: store exports, list them, restore
them and rebuild the concatenated set byte for byte; the refusals exit with status 2."""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "recipe_data.sh"

pytestmark = pytest.mark.skipif(not (shutil.which("git") and shutil.which("xz")), reason="needs git and xz")


def run(repo: Path, *args: str, check: bool = True, current: str = "") -> subprocess.CompletedProcess:
    """The script in `repo`; `current` names its current drafter ("": the newest kept one)."""
    env = {**os.environ, "RECIPE_CURRENT_DRAFTER": current}
    proc = subprocess.run(["bash", "scripts/recipe_data.sh", *args], cwd=repo, capture_output=True, text=True, env=env)
    if check and proc.returncode:
        raise AssertionError(f"{args}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "recipe_data.sh")
    (root / "README.md").write_text("product\n")
    git(root, "init", "-q")
    git(root, "config", "user.email", "t@example.com")
    git(root, "config", "user.name", "t")
    git(root, "add", "-A")
    git(root, "commit", "-qm", "init")
    return root


def rows(*ids: str) -> str:
    return "".join(json.dumps({"id": i, "messages": [{"role": "user", "content": f"q {i}"}]}) + "\n" for i in ids)


def test_exports_concatenate_to_the_generated_file_and_leave_the_tree_alone(repo: Path) -> None:
    gen = repo / "gen.jsonl"
    gen.write_text(rows("a", "b", "c"))
    tree_before = git(repo, "ls-tree", "-r", "--name-only", "HEAD")
    assert "kept 3 conversations as day1" in run(repo, "store", "day1", "gen.jsonl", "first run").stdout
    gen.write_text(rows("a", "b", "c", "d", "e"))  # a resumed run appends to the same file
    assert run(repo, "rows", "gen.jsonl").stdout == rows("d", "e")
    run(repo, "store", "day2", "gen.jsonl")
    # the branch's files are unchanged: the data lives only in the merged data commits
    assert git(repo, "ls-tree", "-r", "--name-only", "HEAD") == tree_before
    listing = run(repo, "list").stdout.splitlines()
    assert [line.split()[2] for line in listing[:2]] == ["day1", "day2"]
    assert listing[0].split()[3] == "3" and listing[1].split()[3] == "2"
    assert listing[-1] == "5 rows in 2 export(s)"
    out = repo / "restored"
    run(repo, "restore", str(out))
    files = sorted(out.glob("*.jsonl.xz"))
    assert [f.name for f in files] == ["001-day1.jsonl.xz", "002-day2.jsonl.xz"]
    assert b"".join(lzma.decompress(f.read_bytes()) for f in files).decode() == gen.read_text()


def test_a_clone_restores_the_same_rows(repo: Path, tmp_path: Path) -> None:
    (repo / "gen.jsonl").write_text(rows("x", "y"))
    run(repo, "store", "only", "gen.jsonl")
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    run(clone, "restore", "r")
    assert lzma.decompress((clone / "r" / "001-only.jsonl.xz").read_bytes()).decode() == rows("x", "y")


@pytest.mark.parametrize("case", ["nothing new", "same name", "bad name", "dirty tree", "row without id"])
def test_refusals_exit_2_and_keep_nothing(repo: Path, case: str) -> None:
    gen = repo / "gen.jsonl"
    gen.write_text(rows("a"))
    run(repo, "store", "first", "gen.jsonl")
    head = git(repo, "rev-parse", "HEAD")
    name = "first2"
    if case == "same name":
        gen.write_text(rows("a", "b"))
        name = "first"
    elif case == "bad name":
        gen.write_text(rows("a", "b"))
        name = "../up"
    elif case == "dirty tree":
        gen.write_text(rows("a", "b"))
        (repo / "README.md").write_text("edited\n")
    elif case == "row without id":
        gen.write_text(rows("a") + json.dumps({"messages": []}) + "\n")
    proc = run(repo, "store", name, "gen.jsonl", check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("recipe_data: ") and len(proc.stderr.strip().splitlines()) == 1
    assert git(repo, "rev-parse", "HEAD") == head


def merge_by_hand(repo: Path, folder: Path, prefix: str, message: str) -> None:
    """FOLDER's files as PREFIX/<file> in a commit of their own, merged as the script merges its own:
    a kept export or drafter the script did not write (a tampered or corrupt one)."""
    env = {"GIT_INDEX_FILE": str(repo / ".git" / "tmp-index"), "PATH": "/usr/bin:/bin"}
    for f in sorted(folder.iterdir()):
        sha = git(repo, "hash-object", "-w", str(f)).strip()
        subprocess.run(["git", "update-index", "--add", "--cacheinfo", f"100644,{sha},{prefix}/{f.name}"],
                       cwd=repo, check=True, env=env)
    tree = subprocess.run(["git", "write-tree"], cwd=repo, check=True, capture_output=True, text=True,
                          env=env).stdout.strip()
    commit = git(repo, "commit-tree", tree, "-m", message).strip()
    git(repo, "merge", "-q", "-s", "ours", "--allow-unrelated-histories", "--no-edit", commit)


def test_restore_refuses_an_export_whose_manifest_disagrees(repo: Path, tmp_path: Path) -> None:
    (repo / "gen.jsonl").write_text(rows("a"))
    run(repo, "store", "good", "gen.jsonl")
    # a hand-made data commit whose manifest names another checksum
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "conversations.jsonl.xz").write_bytes(lzma.compress(rows("z").encode()))
    (bad / "manifest.json").write_text(json.dumps({"name": "bad", "date": "2026-01-01", "rows": 1,
                                                   "sha256_xz": "0" * 64}))
    merge_by_hand(repo, bad, "recipe-data/bad", "recipe data: bad (1 conversations)")
    proc = run(repo, "restore", "out", check=False)
    assert proc.returncode == 2
    assert "bad: sha256" in proc.stderr and "0" * 64 in proc.stderr
    assert not list((repo / "out").glob("*bad*"))


def drafter_dir(root: Path, weights: bytes) -> Path:
    """A drafter folder as a run's final/ holds it (the script checks files, not their contents)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}) + "\n")
    (root / "model.safetensors").write_bytes(weights)
    return root


def test_drafters_round_trip_through_a_clone_newest_first_or_by_name(repo: Path, tmp_path: Path) -> None:
    tree_before = git(repo, "ls-tree", "-r", "--name-only", "HEAD")
    first = drafter_dir(tmp_path / "stage1", bytes(range(256)) * 40)
    second = drafter_dir(tmp_path / "stage2", b"\x01\x02" * 999)
    assert "kept the drafter" in run(repo, "store-drafter", "stage1", str(first), "six epochs").stdout
    run(repo, "store-drafter", "stage2", str(second))
    (repo / "gen.jsonl").write_text(rows("a"))
    run(repo, "store", "day1", "gen.jsonl")  # data and drafters are listed apart
    assert git(repo, "ls-tree", "-r", "--name-only", "HEAD") == tree_before
    listing = run(repo, "list").stdout.splitlines()
    assert listing[1] == "1 rows in 1 export(s)"
    assert [line.split()[2] for line in listing[2:]] == ["stage1", "stage2"]
    assert listing[2].split()[3:6] == ["0.0", "MB", "six"]
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    run(clone, "restore-drafter", "newest")
    assert (clone / "newest" / "model.safetensors").read_bytes() == b"\x01\x02" * 999
    assert sorted(p.name for p in (clone / "newest").iterdir()) == [".recipe-drafter", "config.json",
                                                                    "model.safetensors"]
    assert json.loads((clone / "newest" / ".recipe-drafter").read_text())["name"] == "stage2"
    run(clone, "restore-drafter", "older", "stage1")
    assert (clone / "older" / "model.safetensors").read_bytes() == bytes(range(256)) * 40
    # restoring over an earlier restore replaces it whole
    run(clone, "restore-drafter", "older")
    assert (clone / "older" / "model.safetensors").read_bytes() == b"\x01\x02" * 999


@pytest.mark.parametrize("case", ["no weights", "same name", "bad name", "dirty tree", "unknown name", "none kept",
                                  "onto other files"])
def test_drafter_refusals_exit_2_and_keep_nothing(repo: Path, tmp_path: Path, case: str) -> None:
    good = drafter_dir(tmp_path / "good", b"w" * 10)
    if case != "none kept":
        run(repo, "store-drafter", "first", str(good))
    head = git(repo, "rev-parse", "HEAD")
    if case == "onto other files":  # a folder that holds something else is never replaced
        (repo / "out").mkdir()
        (repo / "out" / "notes.txt").write_text("mine\n")
        proc = run(repo, "restore-drafter", "out", check=False)
        assert (repo / "out" / "notes.txt").read_text() == "mine\n"
        assert sorted(p.name for p in (repo / "out").iterdir()) == ["notes.txt"]
    elif case in ("unknown name", "none kept"):
        proc = run(repo, "restore-drafter", "out", *(["nope"] if case == "unknown name" else []), check=False)
        named = " named nope" if case == "unknown name" else ""
        assert proc.stderr == f"recipe_data: no drafter{named} kept in this repository's history\n"
        assert not (repo / "out").exists()
    else:
        args = {"no weights": ("second", str(tmp_path)), "same name": ("first", str(good)),
                "bad name": ("../up", str(good)), "dirty tree": ("second", str(good))}[case]
        if case == "dirty tree":
            (repo / "README.md").write_text("edited\n")
        proc = run(repo, "store-drafter", *args, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("recipe_data: ") and len(proc.stderr.strip().splitlines()) == 1
    assert git(repo, "rev-parse", "HEAD") == head


def test_the_current_drafter_is_restored_over_a_newer_stage(repo: Path, tmp_path: Path) -> None:
    run(repo, "store-drafter", "stage1", str(drafter_dir(tmp_path / "stage1", b"1" * 10)))
    run(repo, "store-drafter", "stage2", str(drafter_dir(tmp_path / "stage2", b"2" * 10)))
    assert run(repo, "restore-drafter", "out", current="stage1").stdout == "restored the drafter stage1 into out\n"
    assert (repo / "out" / "model.safetensors").read_bytes() == b"1" * 10
    listing = run(repo, "list", current="stage1").stdout.splitlines()
    assert [line.endswith("(current)") for line in listing[1:]] == [True, False]
    run(repo, "restore-drafter", "out", "stage2", current="stage1")  # a name given wins
    assert (repo / "out" / "model.safetensors").read_bytes() == b"2" * 10
    proc = run(repo, "restore-drafter", "other", current="gone", check=False)
    assert (proc.returncode, proc.stderr) == (2, "recipe_data: no drafter named gone kept in this repository's history\n")


def test_the_scripts_current_drafter_is_kept_in_this_repositorys_history() -> None:
    """CURRENT_DRAFTER names a drafter this checkout's history keeps (a typo would fail every restore)."""
    top = SCRIPT.parents[1]
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=top, capture_output=True, text=True)
    if shallow.returncode or shallow.stdout.strip() == "true":
        pytest.skip("not a git checkout, or a shallow clone: no kept drafter to find")
    name = re.search(r"^CURRENT_DRAFTER=\$\{RECIPE_CURRENT_DRAFTER-([^}]+)\}$", SCRIPT.read_text(), re.M).group(1)
    kept = git(top, "log", "HEAD", "--format=%s", "--grep=^recipe drafter: ").splitlines()
    assert any(subject.startswith(f"recipe drafter: {name}:") for subject in kept), (name, kept)


@pytest.mark.parametrize("case", ["other checksum", "file missing"])
def test_restore_drafter_refuses_a_file_its_manifest_disagrees_with(repo: Path, tmp_path: Path, case: str) -> None:
    good = drafter_dir(tmp_path / "good", b"w" * 10)
    run(repo, "store-drafter", "good", str(good))
    # a hand-made drafter commit whose manifest names another checksum for the weights, or a file it lacks
    bad = drafter_dir(tmp_path / "bad", b"x" * 10)
    files = {"config.json": hashlib.sha256((bad / "config.json").read_bytes()).hexdigest(),
             "model.safetensors": "0" * 64}
    if case == "file missing":
        files["model.safetensors"] = hashlib.sha256(b"x" * 10).hexdigest()
        (bad / "model.safetensors").unlink()
    (bad / "manifest.json").write_text(json.dumps({"name": "bad", "date": "2026-01-01", "bytes": 1, "note": "",
                                                   "files": files}))
    run(repo, "restore-drafter", "out")  # an earlier restore there stays as it was
    merge_by_hand(repo, bad, "recipe-drafter/bad", "recipe drafter: bad")
    proc = run(repo, "restore-drafter", "out", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    expected = ("bad/model.safetensors: sha256 differs from its manifest" if case == "other checksum"
                else "bad/model.safetensors: listed in its manifest, missing from its commit")
    assert proc.stderr.startswith(f"recipe_data: {expected}")
    assert (repo / "out" / "model.safetensors").read_bytes() == b"w" * 10
    assert not list(repo.glob(".out.*"))  # no temporary folder left beside it


def _tree_digest(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_restore_drafter_takes_a_trailing_slash_and_replaces_only_its_own_restores(repo: Path, tmp_path: Path) -> None:
    run(repo, "store-drafter", "one", str(drafter_dir(tmp_path / "one", b"1" * 10)))
    assert run(repo, "restore-drafter", "out/").stdout == "restored the drafter one into out\n"
    assert (repo / "out" / "model.safetensors").read_bytes() == b"1" * 10
    run(repo, "store-drafter", "two", str(drafter_dir(tmp_path / "two", b"2" * 10)))
    run(repo, "restore-drafter", "out/")  # onto the earlier restore, named with the slash: replaced whole
    assert (repo / "out" / "model.safetensors").read_bytes() == b"2" * 10
    assert sorted(p.name for p in (repo / "out").iterdir()) == [".recipe-drafter", "config.json", "model.safetensors"]
    assert not list(repo.glob(".out.*"))


@pytest.mark.parametrize("dest", ["", "/", "mine", "mine/", "linked"])
def test_restore_drafter_never_replaces_a_folder_it_did_not_make(repo: Path, tmp_path: Path, dest: str) -> None:
    run(repo, "store-drafter", "one", str(drafter_dir(tmp_path / "one", b"1" * 10)))
    mine = drafter_dir(repo / "mine", b"my own export")  # what `dflash-train export` writes, and notes of mine
    (mine / "notes.txt").write_text("keep\n")
    (repo / "linked").symlink_to(mine)
    before = _tree_digest(mine)
    proc = run(repo, "restore-drafter", dest, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    if dest in ("", "/"):
        assert proc.stderr == f"recipe_data: DIR '{dest}': name the folder to restore into\n"
    else:
        assert proc.stderr == (f"recipe_data: {dest.rstrip('/')} exists and was not made by restore-drafter (no "
                               f".recipe-drafter in it): name a new folder; nothing there is replaced\n")
    assert _tree_digest(mine) == before and not list(repo.glob(".mine.*"))


def test_store_drafter_refuses_a_file_restore_could_not_give_back(repo: Path, tmp_path: Path) -> None:
    folder = drafter_dir(tmp_path / "d", b"w" * 10)
    (folder / "my notes.txt").write_text("x")
    head = git(repo, "rev-parse", "HEAD")
    proc = run(repo, "store-drafter", "d", str(folder), check=False)
    assert proc.returncode == 2 and proc.stderr == (
        f"recipe_data: {folder}/my notes.txt: a file name restore cannot give back (letters, digits, '.', '_' and "
        f"'-' only, not starting with '.'): rename it or move it out\n")
    assert git(repo, "rev-parse", "HEAD") == head


@pytest.mark.parametrize("name", ["../victim.txt", "/tmp/victim.txt", "a b.txt"])
def test_a_manifest_naming_a_path_outside_the_drafter_writes_nothing(repo: Path, tmp_path: Path, name: str) -> None:
    victim = repo / "victim.txt"
    victim.write_text("precious\n")
    bad = drafter_dir(tmp_path / "bad", b"x" * 10)
    files = {n: hashlib.sha256((bad / n).read_bytes()).hexdigest() for n in ("config.json", "model.safetensors")}
    files[name] = "0" * 64
    (bad / "manifest.json").write_text(json.dumps({"name": "bad", "date": "2026-01-01", "bytes": 1, "note": "",
                                                   "files": files}))
    merge_by_hand(repo, bad, "recipe-drafter/bad", "recipe drafter: bad")
    proc = run(repo, "restore-drafter", "out", check=False)
    assert proc.returncode == 2 and proc.stderr == (
        f"recipe_data: bad: its manifest names {name!r} (sha256 '{'0' * 64}'): not a file name or checksum this "
        f"script writes; nothing was restored\n")
    assert victim.read_text() == "precious\n" and not (repo / "out").exists() and not list(repo.glob(".out.*"))


def test_rows_of_a_file_with_a_torn_last_line_print_nothing_and_say_so(repo: Path) -> None:
    (repo / "gen.jsonl").write_text(rows("a", "b") + '{"id": "c", "messa')
    proc = run(repo, "rows", "gen.jsonl", check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("recipe_data: gen.jsonl:3: a torn last line (no newline: a run stopped while writing it); "
                           "rerun generate on the file (it drops the line and resumes), then again\n")


def test_outside_a_repository_and_in_a_shallow_clone_it_says_what_to_do(repo: Path, tmp_path: Path) -> None:
    outside = tmp_path / "plain"
    outside.mkdir()
    proc = subprocess.run(["bash", str(repo / "scripts" / "recipe_data.sh"), "list"], cwd=outside, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == "recipe_data: not inside a git repository: run it in a clone of this project\n"
    run(repo, "store-drafter", "one", str(drafter_dir(tmp_path / "one", b"1" * 10)))
    shallow = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{repo}", str(shallow)], check=True)
    proc = run(shallow, "restore-drafter", "d", check=False)
    assert proc.returncode == 2 and proc.stderr == (
        "recipe_data: no drafter kept in this repository's history; this clone is shallow (git clone --depth): run "
        "'git fetch --unshallow' to fetch the history they live in\n")
    assert "this clone is shallow" in run(shallow, "list").stdout
