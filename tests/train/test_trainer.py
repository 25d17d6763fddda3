"""The single-process trainer on CPU with tiny random Llama and Qwen3 targets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dflash_train.train.step as step_mod
from dflash_train.drafter.checkpoint import load_drafter
from dflash_train.train.checkpoint import latest_checkpoint, latest_valid_checkpoint
from dflash_train.train.config import TrainConfig
from dflash_train.train.trainer import Trainer
from dflash_train.utils.config import load_config
from dflash_train.utils.errors import ConfigError, DataError, InputError, TrainingError
from dflash_train.utils.fs import remove_stale_temp_dirs

from ..conftest import ON_CPU, build_tokenizer, prepare_dataset, synthetic_conversations


def make_config(target, data, out, **overrides) -> TrainConfig:
    base = {
        "target.path": str(target), "data.path": str(data), "run.output_dir": str(out),
        "data.plan.token_budget": 512, "drafter.num_layers": 2, "drafter.block_size": 4, "step.num_anchors": 32,
        "optim.lr": 3e-3, "optim.warmup_steps": 2, "run.max_steps": 12, "run.log_every": 1, "run.save_every": 4,
        "run.progress": False, "run.tensorboard": False, **ON_CPU,
    }
    base.update({k: str(v) for k, v in overrides.items()})
    return load_config(TrainConfig, None, base)


def read_metrics(out: Path, kind: str = "train") -> dict[int, dict]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {r["step"]: r for r in rows if r["kind"] == kind}


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_loss_goes_down(kind, tiny_targets, tiny_datasets, tmp_path):
    cfg = make_config(tiny_targets[kind], tiny_datasets[kind], tmp_path / "run", **{
        "run.max_steps": 40, "run.log_every": 10, "run.save_every": 100, "optim.lr": 1e-2,
        "data.eval_fraction": 0.1, "data.plan.token_budget": 256})
    summary = Trainer(cfg).fit()
    m = read_metrics(tmp_path / "run")
    assert m[40]["loss"] < m[10]["loss"] - 0.15, (m[10]["loss"], m[40]["loss"])
    assert m[40]["tau"] > m[10]["tau"]
    assert summary["eval"]["tau"] >= 1.0 and (tmp_path / "run" / "final" / "model.safetensors").is_file()
    for k in ("acc_1", "acc_2", "acc_3", "tok_per_s", "lr", "time_target_s", "time_backward_s"):
        assert k in m[40]
    # the end's evaluation row says how many training tokens its drafter had seen: a learning curve's x
    evaluated = read_metrics(tmp_path / "run", "eval")
    assert evaluated[40]["tokens_seen"] == summary["tokens"] == sum(r["window_tokens"] for r in m.values()) > 0


def _train_cmd(cfg_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dflash_train", "train", "--config", str(cfg_path), *extra]


def test_sigkill_and_resume_equals_uninterrupted_run(tiny_targets, tiny_datasets, tmp_path):
    """A run SIGKILLed at arbitrary moments and resumed gives the same losses, step for step."""
    import yaml

    from dflash_train.utils.config import to_dict

    steps = 14

    def write_cfg(name):
        cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / name,
                          **{"run.max_steps": steps, "run.save_every": 3, "step.noise_sigma": 0.05})
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(to_dict(cfg)))
        return path

    # one thread in every run: fitted to the idle cores, the count (and so the float sums)
    # could differ between the reference and a resumed run on a busy machine
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    ref = subprocess.run(_train_cmd(write_cfg("ref")), env=env, capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    cfg_b = write_cfg("killed")
    out_b = tmp_path / "killed"
    kills = 0
    for attempt in range(6):
        args = _train_cmd(cfg_b, *(["--resume"] if attempt else []))
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if attempt >= 2:  # let it finish
            _, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err[-2000:]
            break
        # kill once a checkpoint exists beyond the last one, at a moment that varies
        deadline = time.time() + 120
        start_ckpt = latest_checkpoint(out_b / "checkpoints")
        while time.time() < deadline and latest_checkpoint(out_b / "checkpoints") == start_ckpt:
            time.sleep(0.05)
        time.sleep(0.2 * (attempt + 1))
        proc.kill()  # SIGKILL
        proc.wait()
        kills += 1
    assert kills == 2
    ref_m, got_m = read_metrics(tmp_path / "ref"), read_metrics(out_b)
    assert sorted(ref_m) == sorted(got_m) == list(range(1, steps + 1))
    for s in range(1, steps + 1):
        assert got_m[s]["loss"] == ref_m[s]["loss"], s
        assert got_m[s]["tau"] == ref_m[s]["tau"], s
    a, b = load_drafter(tmp_path / "ref" / "final"), load_drafter(out_b / "final")
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n


def test_kill_during_checkpoint_write_leaves_the_previous_checkpoint(tiny_targets, tmp_path):
    """SIGKILL in the middle of writing a checkpoint: the half-written one is never picked up."""
    code = f"""
import os, signal, torch
from pathlib import Path
from dflash_train.drafter.model import DFlashDrafter
from dflash_train.drafter.config import DrafterConfig
import dflash_train.train.checkpoint as ck
cfg = DrafterConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=16,
                    vocab_size=10, target_layer_ids=[0], num_target_layers=2, mask_token_id=1, num_hidden_layers=1, block_size=2)
m = DFlashDrafter(cfg); opt = torch.optim.AdamW(m.parameters()); sch = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
root = Path({str(tmp_path)!r})
ck.save_checkpoint(root, drafter=m, optimizer=opt, scheduler=sch, state=ck.TrainState(step=1), config={{}}, keep_last=3)
real_save = torch.save
def dying_save(obj, path, *a, **k):
    real_save(obj, path, *a, **k)
    os.kill(os.getpid(), signal.SIGKILL)
torch.save = dying_save
ck.save_checkpoint(root, drafter=m, optimizer=opt, scheduler=sch, state=ck.TrainState(step=2), config={{}}, keep_last=3)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-1500:]
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert "step-00000001" in leftovers and "step-00000002" not in leftovers
    assert any(".tmp-" in name for name in leftovers)  # the torn write is still there, under a temp name
    assert latest_checkpoint(tmp_path).name == "step-00000001"
    # ... named after its dead writer, so the next save (which calls this) removes it
    assert remove_stale_temp_dirs(tmp_path) and [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert latest_valid_checkpoint(tmp_path).name == "step-00000001"


def test_export_then_load_gives_identical_outputs(tiny_targets, tiny_datasets, tmp_path):
    from dflash_train.train.export_cli import export

    cfg = make_config(tiny_targets["qwen3"], tiny_datasets["qwen3"], tmp_path / "run", **{"run.max_steps": 3})
    t = Trainer(cfg)
    t.fit()
    out = export(tmp_path / "run", tmp_path / "exported", dtype=torch.float32)
    loaded = load_drafter(out)
    torch.manual_seed(0)
    H = t.drafter_config.hidden_size
    ctx = torch.randn(1, 10, t.drafter_config.num_taps * H)
    pos = torch.arange(10)[None]
    from dflash_train.drafter.masks import build_layer_masks

    doc = torch.zeros(1, 10, dtype=torch.long)
    anchors, valid = torch.tensor([[2, 6]]), torch.ones(1, 2, dtype=torch.bool)
    masks = build_layer_masks(t.drafter_config, doc, pos, anchors, valid, backend="dense")
    blk = torch.randn(1, 8, H)
    bpos = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9]])
    t.drafter.eval()
    assert torch.equal(t.drafter(ctx, pos, blk, bpos, masks), loaded(ctx, pos, blk, bpos, masks))
    with pytest.raises(InputError):
        export(tmp_path / "nothing", tmp_path / "x")


# ---------------------------------------------------------------- clear errors, before heavy work


def test_error_tapped_layer_outside_target(tiny_targets, tiny_datasets, tmp_path, refuse_models):
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "r", **{"drafter.target_layer_ids": "[1, 9]"})
    with pytest.raises(ConfigError, match=r"outside the target's decoder layers 0\.\.5"):
        Trainer(cfg)


def test_error_mask_token_outside_embedding(tiny_targets, tiny_datasets, tmp_path, refuse_models):
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "r", **{"drafter.mask_token_id": 300})
    with pytest.raises(ConfigError, match="outside the embedding table"):
        Trainer(cfg)


def test_error_dataset_from_another_tokenizer(tiny_targets, tmp_path, refuse_models):
    other = tmp_path / "other"
    build_tokenizer(other)
    tok_cfg = json.loads((other / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (other / "chat_template.jinja").unlink(missing_ok=True)
    data = prepare_dataset(other, synthetic_conversations(20), tmp_path / "data")
    cfg = make_config(tiny_targets["llama"], data, tmp_path / "r")
    with pytest.raises(DataError, match="different tokenizer"):
        Trainer(cfg)


def test_error_empty_dataset(tiny_targets, tmp_path, refuse_models):
    from dflash_train.data.shards import MANIFEST

    data = prepare_dataset(tiny_targets["llama"], synthetic_conversations(3), tmp_path / "data")
    manifest = json.loads((data / MANIFEST).read_text())
    manifest["shards"] = []  # as a dataset with no rows would say
    (data / MANIFEST).write_text(json.dumps(manifest))
    cfg = make_config(tiny_targets["llama"], data, tmp_path / "r")
    with pytest.raises(DataError, match="empty"):
        Trainer(cfg)


def test_error_budget_smaller_than_longest_row(tiny_targets, tiny_datasets, tmp_path, refuse_models):
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "r", **{"data.plan.token_budget": 20})
    with pytest.raises(ConfigError, match="token budget is smaller than the longest row"):
        Trainer(cfg)


def test_error_existing_run_without_resume(tiny_targets, tiny_datasets, tmp_path):
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "r", **{"run.max_steps": 1})
    Trainer(cfg).fit()
    with pytest.raises(TrainingError, match="--resume"):
        Trainer(cfg)


def test_nonfinite_steps_are_skipped_counted_and_stop_the_run(tiny_targets, tiny_datasets, tmp_path, monkeypatch):
    real_step = step_mod.drafter_step
    calls = {"n": 0}

    def flaky(*a, **k):
        calls["n"] += 1
        stats = real_step(*a, **k)
        if calls["n"] in (3, 5, 6, 7):  # one isolated bad step, then three in a row
            stats.loss_sum = stats.loss_sum * float("nan")
        return stats

    monkeypatch.setattr(step_mod, "drafter_step", flaky)
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "r", **{"run.max_bad_steps": 3})
    t = Trainer(cfg)
    with pytest.raises(TrainingError, match="3 non-finite steps in a row"):
        t.fit()
    assert t.state.bad_steps_total == 4 and t.state.step == 3  # steps 1, 2, 4 were applied
    rows = [json.loads(ln) for ln in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert sum(1 for r in rows if r.get("skipped_nonfinite")) == 4
    for p in t.drafter.parameters():
        assert torch.isfinite(p).all()


def test_resume_without_a_checkpoint_exits_2_and_resume_auto_starts_fresh(tiny_targets, tiny_datasets, tmp_path,
                                                                          capsys):
    from dflash_train.cli import main

    out = tmp_path / "r"
    args = ["train", "--target.path", str(tiny_targets["llama"]), "--data.path", str(tiny_datasets["llama"]),
            "--run.output_dir", str(out), "--data.plan.token_budget", "512", "--drafter.num_layers", "1",
            "--drafter.block_size", "4", "--step.num_anchors", "8", "--run.max_steps", "2", "--run.progress", "false",
            "--run.tensorboard", "false", "--run.device", "cpu"]
    assert main([*args, "--resume"]) == 2
    assert f"--resume: no checkpoint in {out / 'checkpoints'}" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()
    assert main([*args, "--resume", "auto"]) == 0
    assert max(read_metrics(out)) == 2
    assert main([*args, "--resume"]) == 0  # now there is one: continues (nothing left to train)


def _profiled_calls(table: str, name: str) -> int:
    """'# of Calls' (the table's last column) of the row named `name`."""
    rows = [ln.split() for ln in table.splitlines() if ln.strip().startswith(name + " ")]
    assert len(rows) == 1, table
    return int(rows[0][-1])


@pytest.mark.parametrize("span,max_steps,written", [("3-4", 6, "steps-3-4.txt"), ("3-9", 4, "steps-3-4.txt")])
def test_profile_steps_records_exactly_those_steps(tiny_targets, tiny_datasets, tmp_path, span, max_steps, written):
    """run.profile_steps: the table covers optimizer steps FIRST..LAST (two here, each with its
    forward, backward and optimizer ranges; 2 micro-batches a step), also when the run ends
    before LAST; steps outside the span are not recorded."""
    out = tmp_path / "run"
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], out, **{
        "run.profile_steps": span, "run.max_steps": max_steps, "optim.grad_accum": 2, "run.checkpoint": False,
        "pipeline.queue_depth": 2})
    Trainer(cfg).fit()
    files = sorted(p.name for p in (out / "profile").iterdir())
    assert files == sorted([written, "trace.json"])
    table = (out / "profile" / written).read_text()
    assert _profiled_calls(table, "train_step") == 2
    assert _profiled_calls(table, "forward") == 4 and _profiled_calls(table, "backward") == 4
    assert _profiled_calls(table, "optimizer") == 2
    assert "GPU idle: no device ops in the trace (a CPU run)" in table  # the gap report's CPU answer


@pytest.mark.parametrize("bad", ["5-3", "0-2", "x", "3-"])
def test_profile_steps_rejects_a_bad_span(tiny_targets, tiny_datasets, tmp_path, bad):
    with pytest.raises(ConfigError, match="run.profile_steps"):
        make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path, **{"run.profile_steps": bad})
