"""The trainer with drafter.variant=dspark on CPU: the loss goes down, a run resumed from a
checkpoint continues exactly as the uninterrupted run (the bigram head and its own learning
rate included), and a DFlash
drafter starts a dspark run, or one with more layers (drafter.init_from), drafting as it did."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.train.trainer import Trainer
from dflash_train.utils.errors import TrainingError

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
    # the head in its own parameter group: both groups' moments and lrs go through the checkpoint
    overrides = {"run.max_steps": 8, "run.save_every": 4, "optim.markov_lr_scale": 4.0, **DSPARK}
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


@pytest.mark.parametrize("grow,zeroed", [
    (DSPARK, ["markov_head.markov_w2.weight"]),
    ({"drafter.num_layers": 3}, ["layers.2.self_attn.o_proj.weight", "layers.2.mlp.down_proj.weight"]),
], ids=["dspark-head", "one-more-layer"])
def test_a_run_started_from_a_smaller_drafter_drafts_as_it_did_then_trains_what_it_added(
        tiny_targets, tiny_datasets, tmp_path, grow, zeroed):
    """drafter.init_from a DFlash drafter into a dspark run, or into one with a layer more: every
    saved tensor as saved, the added parts' last weights zero, so before any step its held-out
    estimate and measured walk equal those of the same saved drafter started as it was (the
    added parts add exact zeros); two steps later the zeroed weights have moved."""
    base = {"run.max_steps": 4, "run.save_every": 100, "data.eval_fraction": 0.1,
            "data.plan.token_budget": 256}
    Trainer(make_config(tiny_targets["qwen3"], tiny_datasets["qwen3"], tmp_path / "dflash", **base)).fit()
    final = str(tmp_path / "dflash" / "final")
    saved = load_file(final + "/model.safetensors")
    start = {**base, "run.max_steps": 2, "drafter.init_from": final}
    as_saved = Trainer(make_config(tiny_targets["qwen3"], tiny_datasets["qwen3"], tmp_path / "again", **start))
    grown = Trainer(make_config(tiny_targets["qwen3"], tiny_datasets["qwen3"], tmp_path / "grown", **start, **grow))
    state = {k: v.detach() for k, v in grown.drafter.state_dict().items()}
    assert set(saved) < set(state) and all(torch.equal(state[k].to(saved[k].dtype), saved[k]) for k in saved)
    assert all(not state[k].any() for k in zeroed)
    want, got = as_saved.evaluate(), grown.evaluate()
    for key in ("tau", "ce", "acc_1", "acc_3"):
        assert got["estimate"][key] == want["estimate"][key], (key, got["estimate"][key], want["estimate"][key])
    assert got["measured"]["tau"] == want["measured"]["tau"]  # held-out speculative decoding: the same drafts
    grown.fit()
    moved = {k: v.detach() for k, v in grown.drafter.state_dict().items()}
    assert all(moved[k].abs().sum() > 0 for k in zeroed)


def test_a_dspark_drafter_cannot_start_a_dflash_run(tiny_targets, tiny_datasets, tmp_path):
    overrides = {"run.max_steps": 2, "run.save_every": 100}
    Trainer(make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "dspark",
                        **overrides, **DSPARK)).fit()
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "dflash", **overrides,
                      **{"drafter.init_from": str(tmp_path / "dspark" / "final")})
    with pytest.raises(TrainingError, match=r"that drafter does not fit this run's config \(variant: 'dspark' there "
                                            r"vs 'dflash' in this run; markov_rank: 16 there vs 256 in this run\)"):
        Trainer(cfg)
