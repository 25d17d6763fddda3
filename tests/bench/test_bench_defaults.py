"""`dflash-train bench` defaults to the settings `train` picks (auto), and its lever table pins every row's
target forward, so that the baseline stays the Hugging Face forward whatever the defaults are."""

import dataclasses

import pytest
import torch

from dflash_train.bench.cli import BenchConfig, build_config, decide_auto_settings
from dflash_train.bench.levers import LEVERS
from dflash_train.target.presets import PRESETS
from dflash_train.utils.config import load_config


def _decided(tmp_path, device: str, **fields):
    cfg = decide_auto_settings(build_config(BenchConfig(**fields), tmp_path), torch.device(device))
    return cfg.target.forward, cfg.target.compile, cfg.run.compile, cfg.run.drafter_dtype


def test_the_defaults_are_auto_and_decide_the_fast_path_on_a_gpu(tmp_path):
    args = BenchConfig()
    assert (args.target_forward, args.target_compile, args.compile, args.drafter_dtype) == ("auto",) * 4
    # deciding reads the device's type only: no GPU is touched
    assert _decided(tmp_path, "cuda", preset="qwen3-8b") == ("packed", True, True, "bfloat16")
    assert _decided(tmp_path, "cpu", preset="qwen3-8b") == ("hf", False, False, "float32")


@pytest.mark.parametrize("preset", ["qwen3.5-27b", "qwen3.5-35b-a3b", "glm4.7-flash"])
def test_hybrid_and_latent_attention_presets_get_the_packed_compiled_forward(tmp_path, preset):
    """(A family the packed forward does not take keeps the Hugging Face forward: every preset is
    taken now, so tests/train/test_fast_path.py checks that on a Mamba config.)"""
    assert _decided(tmp_path, "cuda", preset=preset) == ("packed", True, True, "bfloat16")


def test_a_target_sharded_over_a_group_gets_the_packed_compiled_forward(tmp_path):
    """--target-group-size reaches pipeline.target_group_size, and the 70B preset sharded over two
    GPUs runs the packed compiled forward, which gathers each layer's weights itself."""
    cfg = build_config(BenchConfig(preset="llama3.3-70b", layout="colocated", target_group_size=2), tmp_path)
    assert cfg.pipeline.target_group_size == 2
    assert _decided(tmp_path, "cuda", preset="llama3.3-70b", layout="colocated",
                    target_group_size=2) == ("packed", True, True, "bfloat16")
    assert _decided(tmp_path, "cuda", preset="llama3.3-70b", layout="colocated", target_group_size=2,
                    target_forward="hf") == ("hf", False, True, "bfloat16")


def test_explicit_settings_are_kept(tmp_path):
    assert _decided(tmp_path, "cuda", preset="qwen3-8b", target_forward="hf", target_compile=False, compile=False,
                    drafter_dtype="float32") == ("hf", False, False, "float32")


@pytest.mark.parametrize("name", list(LEVERS))
def test_every_lever_names_its_target_forward(name):
    variant = dataclasses.replace(BenchConfig(levers=name), **LEVERS[name][1])
    assert variant.target_forward in ("hf", "packed") and isinstance(variant.target_compile, bool)
    if name == "baseline" or name.startswith("hf-") or name in ("overlap", "data-labels", "fp8-unfused"):
        assert (variant.target_forward, variant.target_compile) == ("hf", False)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_is_a_bench_choice(name):
    assert load_config(BenchConfig, None, {"preset": name}).preset == name
