"""What a newcomer's first run gets wrong is said before the long wait (train/setup.py: announce_start)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import dflash_train.train.setup as setup_mod
from dflash_train.data.batching import BatchPlanConfig, BatchPlanner
from dflash_train.data.prompts import asset_path
from dflash_train.train.config import TrainConfig
from dflash_train.train.trainer import Trainer
from dflash_train.utils.config import load_config

from .test_trainer import make_config

CPU = torch.device("cpu")


def _cfg(**overrides) -> TrainConfig:
    return load_config(TrainConfig, None, {"data.path": "d", **overrides})


def test_a_small_dataset_under_a_large_budget_and_a_large_compiled_cpu_shape_are_warned() -> None:
    cfg = _cfg(**{"data.plan.token_budget": "49152", "data.plan.row_tokens": "8192", "run.compile": "true"})
    planner = BatchPlanner([100] * 10, BatchPlanConfig(token_budget=49152, row_tokens=8192))
    assert setup_mod.start_warnings(cfg, planner, CPU) == [
        "batches are only 2.0% full (1,000 tokens in 1 batches of data.plan.token_budget 49,152): most of every step "
        "is padding; a smaller data.plan.token_budget (the longest sample has 100 tokens) or more data fits better",
        "compiling for 6 x 8,192-token batches on a CPU (run.compile / target.compile): the first steps wait minutes "
        "for torch.compile and every step is slow at this shape; for a CPU, start from "
        "src/dflash_train/assets/demo_cpu.yaml (no compile, 512-token batches)"]
    assert setup_mod.start_warnings(cfg, planner, torch.device("cuda")) == [
        setup_mod.start_warnings(cfg, planner, CPU)[0]]  # a GPU compiles that shape in about a minute


def test_the_cpu_config_on_its_data_is_not_warned() -> None:
    assert (Path(__file__).parents[2] / setup_mod.CPU_CONFIG).resolve() == asset_path("demo_cpu.yaml").resolve()
    cfg = load_config(TrainConfig, asset_path("demo_cpu.yaml"), {"data.path": "d"})
    planner = BatchPlanner([300] * 100, cfg.data.plan)  # one 300-token chat per 512-token batch: 58.6% full
    assert setup_mod.start_warnings(cfg, planner, CPU) == []


def test_the_warnings_and_the_compiling_line_come_before_the_target_loads(tiny_targets, tiny_datasets, tmp_path,
                                                                          monkeypatch, caplog) -> None:
    def stop(*a, **k):
        raise RuntimeError("the target loads here")

    monkeypatch.setattr(setup_mod, "load_frozen_target", stop)
    cfg = make_config(tiny_targets["llama"], tiny_datasets["llama"], tmp_path / "run",
                      **{"data.plan.token_budget": 16384, "run.compile": True})
    with caplog.at_level(logging.INFO), pytest.raises(RuntimeError, match="the target loads here"):
        Trainer(cfg)
    said = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("batches are only ") for m in said)
    assert any(m.startswith("compiling for 1 x 16,384-token batches on a CPU") for m in said)
    assert "compiling ... the drafter for 1 x 16384-token batches: the first step waits for torch.compile" in said
