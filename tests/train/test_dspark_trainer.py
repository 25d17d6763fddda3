"""The trainer with drafter.variant=dspark on CPU: the loss goes down, and a run resumed from a
checkpoint continues exactly as the uninterrupted run (the bigram head included)."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from dflash_train.train.trainer import Trainer

from .test_trainer import make_config, read_metrics

DSPARK = {"drafter.variant": "dspark", "drafter.markov_rank": 16}


def test_dspark_loss_goes_down(tiny_targets, tiny_datasets, tmp_path):
    cfg = make_config(tiny_targets["qwen3"], tiny_datasets["qwen3"], tmp_path / "run", **{
        "run.max_steps": 40, "run.log_every": 10, "run.save_every": 100, "optim.lr": 1e-2,
        "data.eval_fraction": 0.1, "data.plan.token_budget": 256, **DSPARK})
    summary = Trainer(cfg).fit()
    m = read_metrics(tmp_path / "run")
    assert m[40]["loss"] < m[10]["loss"] - 0.15, (m[10]["loss"], m[40]["loss"])
    assert summary["eval"]["tau"] >= 1.0
    weights = load_file(str(tmp_path / "run" / "final" / "model.safetensors"))
    assert weights["markov_head.markov_w1.weight"].shape[1] == weights["markov_head.markov_w2.weight"].shape[1] == 16


def test_dspark_resume_equals_the_uninterrupted_run(tiny_targets, tiny_datasets, tmp_path):
    overrides = {"run.max_steps": 8, "run.save_every": 4, **DSPARK}
    full = tmp_path / "full"
    Trainer(make_config(tiny_targets["llama"], tiny_datasets["llama"], full, **overrides)).fit()
    resumed = tmp_path / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000008")  # as if the run had stopped after step 4's save
    shutil.rmtree(resumed / "final")
    trainer = Trainer(make_config(tiny_targets["llama"], tiny_datasets["llama"], resumed, **overrides), resume=True)
    assert trainer.state.step == 4  # it continues after step 4, not from the start
    trainer.fit()
    want, got = read_metrics(full), read_metrics(resumed)
    for step in range(5, 9):
        assert got[step]["loss"] == want[step]["loss"], step
    a = load_file(str(full / "final" / "model.safetensors"))
    b = load_file(str(resumed / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and "markov_head.markov_w1.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
