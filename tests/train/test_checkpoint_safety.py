"""Checkpoints verify, resume takes the newest one that does, failed saves change nothing,
export never destroys its source (train/checkpoint.py, train/export_cli.py)."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash_train.train.checkpoint as ck
from dflash_train.drafter.checkpoint import load_drafter
from dflash_train.drafter.config import DrafterConfig
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.train.export_cli import ExportConfig, export
from dflash_train.utils.errors import InputError, OutputError, TrainingError
from dflash_train.utils.fs import MARKER, made_by, writer_tag


def tiny(layers: int = 1) -> DrafterConfig:
    return DrafterConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16,
                         vocab_size=10, target_layer_ids=[0], num_target_layers=2, mask_token_id=1,
                         num_hidden_layers=layers, block_size=2)


def parts(cfg: DrafterConfig | None = None):
    torch.manual_seed(0)
    m = DFlashDrafter(cfg or tiny())
    opt = torch.optim.AdamW(m.parameters())
    for p in m.parameters():  # a step, so the optimizer has state tensors to save
        p.grad = torch.ones_like(p)
    opt.step()
    return m, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


def save(root: Path, step: int, keep_last: int = 5, **kw) -> Path:
    m, opt, sch = parts()
    return ck.save_checkpoint(root, drafter=m, optimizer=opt, scheduler=sch, state=ck.TrainState(step=step),
                              config={"run": {"seed": 0}}, keep_last=keep_last, **kw)


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def flip_a_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated model.safetensors": (lambda d: truncate(d / "drafter" / "model.safetensors"), "truncated"),
    "truncated optimizer.pt": (lambda d: truncate(d / "optimizer.pt"), "optimizer.pt is truncated"),
    "truncated state.json": (lambda d: truncate(d / "state.json"), "state.json is truncated"),
    "missing rng.pt": (lambda d: (d / "rng.pt").unlink(), "rng.pt is missing"),
    "flipped byte": (lambda d: flip_a_byte(d / "optimizer.pt"), "checksum mismatch"),
    "missing state.json": (lambda d: (d / "state.json").unlink(), "state.json is missing"),
    "garbled manifest": (lambda d: (d / ck.MANIFEST).write_text("{"), "manifest.json is unreadable"),
}


def test_manifest_records_every_file_and_is_written_last(tmp_path):
    path = save(tmp_path, 1)
    manifest = json.loads((path / ck.MANIFEST).read_text())
    files = {f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file()} - {ck.MANIFEST}
    assert set(manifest["files"]) == files >= {"drafter/model.safetensors", "optimizer.pt", "state.json", MARKER}
    assert all(e["size"] == (path / n).stat().st_size for n, e in manifest["files"].items())
    assert ck.verify_checkpoint(path) == [] and made_by(path) == "checkpoint"


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_resume_takes_the_newest_checkpoint_that_verifies(tmp_path, caplog, corruption):
    good, bad = save(tmp_path, 1), save(tmp_path, 2)
    damage, reason = CORRUPTIONS[corruption]
    damage(bad)
    assert any(reason in p for p in ck.verify_checkpoint(bad)), ck.verify_checkpoint(bad)
    with caplog.at_level(logging.WARNING, logger=ck.__name__):
        assert ck.latest_valid_checkpoint(tmp_path) == good
    assert f"skipping checkpoint {bad}" in caplog.text and reason in caplog.text


def strip_manifest(path: Path) -> Path:
    (path / ck.MANIFEST).unlink()  # as written by versions before manifests
    return path


def test_old_checkpoints_without_manifest_are_accepted_when_their_files_load(tmp_path, caplog):
    good, bad = strip_manifest(save(tmp_path, 1)), strip_manifest(save(tmp_path, 2))
    assert ck.verify_checkpoint(bad) == []
    truncate(bad / "optimizer.pt")
    with caplog.at_level(logging.WARNING, logger=ck.__name__):
        assert ck.latest_valid_checkpoint(tmp_path) == good
    assert "optimizer.pt does not load" in caplog.text
    m, opt, sch = parts()
    assert ck.load_checkpoint(good, drafter=m, optimizer=opt, scheduler=sch).step == 1


def test_a_checkpoint_that_does_not_load_is_a_training_error_naming_it(tmp_path, monkeypatch):
    path = save(tmp_path, 1)
    truncate(path / "optimizer.pt")
    m, opt, sch = parts()
    with pytest.raises(TrainingError, match=f"{path}: the checkpoint does not load"):
        ck.load_checkpoint(path, drafter=m, optimizer=opt, scheduler=sch)
    path = save(tmp_path, 2)

    def broken_load(*a, **k):
        raise RuntimeError("PytorchStreamReader failed reading zip archive")

    monkeypatch.setattr(torch, "load", broken_load)
    with pytest.raises(TrainingError, match=f"{path}: .*PytorchStreamReader"):
        ck.load_checkpoint(path, drafter=m, optimizer=opt, scheduler=sch)


def test_a_changed_config_is_a_training_error_naming_the_checkpoint(tmp_path):
    path = save(tmp_path, 1)
    m, opt, sch = parts(tiny(layers=2))
    with pytest.raises(TrainingError, match=f"{path}: the checkpoint's drafter config differs"):
        ck.load_checkpoint(path, drafter=m, optimizer=opt, scheduler=sch)
    m, _, sch = parts()
    two_groups = torch.optim.AdamW([{"params": [p]} for p in m.parameters()])  # e.g. optimizer settings changed
    with pytest.raises(TrainingError, match=f"{path}: the checkpoint does not fit this run"):
        ck.load_checkpoint(path, drafter=m, optimizer=two_groups, scheduler=sch)


def test_disk_full_keeps_the_previous_checkpoint_and_leaves_no_temp_dir(tmp_path, monkeypatch):
    previous = save(tmp_path, 1)
    real_save = torch.save

    def disk_full(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        f.truncate(10)  # what made it to disk before the device filled up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(TrainingError, match=r"step-00000002: could not write the checkpoint.*No space left.*"
                                            r"step-00000001, is kept"):
        save(tmp_path, 2)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert ck.latest_valid_checkpoint(tmp_path) == previous


def test_next_save_removes_temp_dirs_of_killed_saves_of_any_step(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    host = writer_tag().split("@", 1)[1]
    stale = tmp_path / f".step-00000007.tmp-{proc.pid}@{host}-0badc0de"
    (stale / "drafter").mkdir(parents=True)
    (stale / "optimizer.pt").write_bytes(b"partial")
    live = tmp_path / f".step-00000008.tmp-{os.getpid()}@{host}-0badc0de"  # another save in progress
    live.mkdir()
    save(tmp_path, 1)
    assert hidden(tmp_path) == [live.name]


def test_keep_last_never_prunes_the_checkpoint_just_saved(tmp_path):
    for step in (1, 2, 3):
        save(tmp_path, step, keep_last=2)
    assert [p.name for _, p in ck.step_dirs(tmp_path)] == ["step-00000002", "step-00000003"]
    # resumed from step 2 because step 3 did not verify: saving step 3 again replaces it
    truncate(tmp_path / "step-00000003" / "optimizer.pt")
    save(tmp_path, 3, keep_last=1)
    assert [p.name for _, p in ck.step_dirs(tmp_path)] == ["step-00000003"]
    assert ck.verify_checkpoint(tmp_path / "step-00000003") == []


@pytest.mark.parametrize("mask, dirs, files", [(0o022, 0o755, 0o644), (0o007, 0o770, 0o660)])
def test_checkpoints_and_exports_follow_the_umask(tmp_path, umask, mask, dirs, files):
    umask(mask)
    ckpt = save(tmp_path / "run" / "checkpoints", 1)
    exported = export(tmp_path / "run", tmp_path / "exported")
    for root in (tmp_path / "run", exported):
        assert {("dir" if p.is_dir() else "file", stat.S_IMODE(p.stat().st_mode))
                for p in [root, *root.rglob("*")]} == {("dir", dirs), ("file", files)}, root
    assert ck.verify_checkpoint(ckpt) == []


# -- the trainer's two uses ----------------------------------------------------------------------


def test_resume_starts_from_the_newest_checkpoint_that_verifies(tmp_path, caplog):
    with pytest.raises(TrainingError, match="no checkpoint in .* --resume auto"):  # never silently from step 0
        ck.checkpoint_to_resume(tmp_path, True)
    assert ck.checkpoint_to_resume(tmp_path, "auto") is None  # nothing yet: from scratch, when asked
    good, bad = save(tmp_path, 1), save(tmp_path, 2)
    truncate(bad / "drafter" / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        assert ck.checkpoint_to_resume(tmp_path, True) == good
    assert ck.checkpoint_to_resume(tmp_path, "auto") == good
    assert "skipping checkpoint" in caplog.text
    with pytest.raises(TrainingError, match="--resume"):
        ck.checkpoint_to_resume(tmp_path, False)
    truncate(good / "state.json")
    with pytest.raises(TrainingError, match="none of its checkpoints verifies"):  # not silently from scratch
        ck.checkpoint_to_resume(tmp_path, True)


def test_trainer_saves_again_over_a_checkpoint_of_this_step_that_does_not_verify(tmp_path):
    bad = save(tmp_path, 2)
    truncate(bad / "optimizer.pt")
    m, opt, sch = parts()
    lines = []
    checkpointer = ck.Checkpointer(tmp_path, drafter=m, optimizer=opt, scheduler=sch, config={}, every=500,
                                   keep_last=3)
    state = ck.TrainState(step=2)
    assert checkpointer.save(state, lines.append) == bad and lines == [f"saved {bad}"]
    assert ck.verify_checkpoint(bad) == []
    assert checkpointer.save(state, lines.append) == bad and len(lines) == 1  # verified: not written twice


# -- export --------------------------------------------------------------------------------------


def test_export_never_destroys_its_source(tmp_path):
    run = tmp_path / "r1"
    ckpt = save(run / "checkpoints", 1)
    for output in (run, run / "checkpoints", ckpt, ckpt / "drafter"):
        with pytest.raises(OutputError, match="input"):
            export(run, output, overwrite=True)
    with pytest.raises(OutputError, match="input"):
        export(ckpt, ckpt, overwrite=True)
    assert ck.verify_checkpoint(ckpt) == [] and hidden(run) == []


def test_export_never_replaces_a_file_or_a_directory_it_did_not_make(tmp_path):
    save(tmp_path / "r1" / "checkpoints", 1)
    a_file = tmp_path / "drafter.bin"
    a_file.write_text("precious")
    with pytest.raises(OutputError, match="is a file"):
        export(tmp_path / "r1", a_file, overwrite=True)
    assert a_file.read_text() == "precious" and hidden(tmp_path) == []
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "README.md").write_text("mine")
    with pytest.raises(OutputError, match="not made by dflash-train"):
        export(tmp_path / "r1", foreign, overwrite=True)
    assert [p.name for p in foreign.iterdir()] == ["README.md"]


def test_export_replaces_an_earlier_export_only_with_overwrite(tmp_path):
    save(tmp_path / "r1" / "checkpoints", 1)
    out = export(tmp_path / "r1", tmp_path / "out")
    assert made_by(out) == "export" and load_drafter(out).config == tiny()
    with pytest.raises(OutputError, match="--overwrite"):
        export(tmp_path / "r1", out)
    assert export(tmp_path / "r1", out, overwrite=True) == out
    assert ExportConfig(source="r1", output="o", overwrite=True).overwrite


def test_export_takes_the_newest_checkpoint_that_verifies(tmp_path, caplog):
    good, bad = save(tmp_path / "r1" / "checkpoints", 1), save(tmp_path / "r1" / "checkpoints", 2)
    truncate(bad / "drafter" / "model.safetensors")
    with caplog.at_level(logging.WARNING):
        export(tmp_path / "r1", tmp_path / "out")
    assert f"skipping checkpoint {bad}" in caplog.text
    with pytest.raises(InputError, match="does not verify"):
        export(bad, tmp_path / "out2")
    truncate(good / "drafter" / "model.safetensors")
    with pytest.raises(InputError, match="none of its checkpoints verifies"):
        export(tmp_path / "r1", tmp_path / "out3")


SIGTERM_MID_WRITE = """
import os, signal, sys
import dflash_train.drafter.checkpoint as checkpoint
real = checkpoint.save

def save_then_terminated(*args, **kwargs):  # SIGTERM while the weights are being written
    data = real(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    return data

checkpoint.save = save_then_terminated
from dflash_train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_export_says_so_and_leaves_nothing_half_written(tmp_path):
    save(tmp_path / "r1" / "checkpoints", 1)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-c", SIGTERM_MID_WRITE, "export", str(tmp_path / "r1"), "-o", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 143, done.stderr
    assert done.stderr.strip().splitlines()[-1] == ("dflash-train export: stopped by SIGTERM before it finished; "
                                                    "nothing half-written is left")
    assert not out.exists() and hidden(tmp_path) == []  # no temporary folder beside it either


def test_export_of_a_finished_run_says_why_it_exists_beside_final(tmp_path, capsys):
    from dflash_train.cli import main
    from dflash_train.drafter.checkpoint import save_drafter

    ckpt = save(tmp_path / "r1" / "checkpoints", 1)
    save_drafter(load_drafter(ckpt / "drafter"), tmp_path / "r1" / "final")  # as a run that ends writes it
    assert main(["export", str(tmp_path / "r1"), "-o", str(tmp_path / "out")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        f"{tmp_path / 'r1' / 'final'} holds the same drafter (a run that ends writes it there); export is for a "
        f"chosen checkpoint, another --dtype, a run stopped before its end, and a folder apart from the run (that "
        f"--resume never touches)")
    assert main(["export", str(tmp_path / "r1"), "-o", str(tmp_path / "out32"), "--dtype", "float32"]) == 0
    assert "holds the same drafter" not in capsys.readouterr().out  # float32 differs from final/'s bf16


@pytest.mark.parametrize("initialized", [False, True])
def test_rng_capture_takes_cuda_generators_only_where_cuda_is_in_use(monkeypatch, initialized):
    """A CPU run on a GPU machine never creates a CUDA context to save generators it never used
    (every rank would take one at its first checkpoint); a process that uses CUDA keeps them."""
    cuda_state = [torch.tensor([1, 2, 3], dtype=torch.uint8)]

    def get_all():
        if not initialized:
            raise AssertionError("a CUDA context was created by a process that never used CUDA")
        return cuda_state

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", get_all)
    tensors, plain = ck.capture_rng()
    assert torch.equal(tensors["torch"], torch.get_rng_state())
    assert ("cuda" in tensors) == initialized
    if initialized:
        assert torch.equal(tensors["cuda"], torch.stack(cuda_state))
