"""Every shipped config loads and validates (a typo in a key or value fails here, not on a GPU)."""

from pathlib import Path

import pytest

from dflash_train.train.config import TrainConfig
from dflash_train.utils.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_configs_are_found():
    assert {p.name for p in CONFIGS} >= {"example.yaml", "smollm2-135m.yaml", "smollm2-135m-diverse.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = load_config(TrainConfig, str(path), {})
    assert cfg.data.path and cfg.run.output_dir
    if cfg.target.compile:
        assert cfg.target.forward == "packed"
