"""Every shipped config loads and validates (a typo in a key or value fails here, not on a GPU)."""

from pathlib import Path

import pytest

from dflash_train.train.config import TrainConfig
from dflash_train.utils.config import load_config
from dflash_train.utils.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_configs_are_found():
    assert {p.name for p in CONFIGS} >= {"example.yaml", "smollm2-135m.yaml", "smollm2-135m-diverse.yaml",
                                        "smollm2-135m-diverse-dspark.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = load_config(TrainConfig, str(path), {})
    assert cfg.data.path and cfg.run.output_dir
    if cfg.target.compile is True:
        assert cfg.target.forward in ("packed", "auto")


def test_the_dspark_recipe_is_the_diverse_recipe_with_the_variant_on():
    base = load_config(TrainConfig, str(CONFIGS[0].parent / "smollm2-135m-diverse.yaml"), {})
    dspark = load_config(TrainConfig, str(CONFIGS[0].parent / "smollm2-135m-diverse-dspark.yaml"), {})
    assert base.drafter.variant == "dflash"
    assert (dspark.drafter.variant, dspark.drafter.markov_rank) == ("dspark", 256)
    assert dspark.run.output_dir != base.run.output_dir
    dspark.drafter.variant, dspark.drafter.markov_rank = base.drafter.variant, base.drafter.markov_rank
    dspark.run.output_dir = base.run.output_dir
    assert (dspark.run.compile, base.run.compile) == (False, True)  # dspark: the eager drafter it was measured with
    dspark.run.compile = base.run.compile
    assert dspark == base  # nothing else differs


def test_an_unknown_variant_is_one_clear_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("drafter:\n  variant: domino\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: drafter.variant: 'domino' is not one of \['dflash', 'dspark'\]"):
        load_config(TrainConfig, str(path), {"data.path": "d", "run.output_dir": "o"})
    with pytest.raises(ConfigError, match="drafter.markov_rank must be >= 1, got 0"):
        load_config(TrainConfig, None, {"data.path": "d", "run.output_dir": "o", "drafter.markov_rank": "0"})


def test_the_recipes_keep_the_settings_they_were_measured_with():
    """The defaults moved to `auto` (the fast path on a GPU); a shipped recipe states what it measured with."""
    from dflash_train.data.prompts import asset_path

    compiled = {"smollm2-135m.yaml": False, "smollm2-135m-diverse.yaml": True, "smollm2-135m-diverse-dspark.yaml": False}
    for name, compile_drafter in compiled.items():
        cfg = load_config(TrainConfig, str(CONFIGS[0].parent / name), {})
        assert (cfg.run.compile, cfg.run.drafter_dtype) == (compile_drafter, "float32"), name
        assert "auto" not in (cfg.target.forward, cfg.target.compile), name
    gpu_demo = load_config(TrainConfig, str(asset_path("demo_gpu.yaml")), {})
    assert (gpu_demo.target.forward, gpu_demo.target.compile, gpu_demo.run.compile, gpu_demo.run.drafter_dtype) == \
        ("hf", False, False, "float32")
