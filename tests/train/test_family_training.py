"""`dflash-train train` on targets beyond Llama/Qwen, with the CPU demo config and default options:
Gemma 2 and gpt-oss (no sdpa attention: auto loads them eager; Gemma 2 soft-caps its logits) and
the Gemma 3 multimodal wrapper (its text layers tapped, its language model's final norm for
`target` labels). Options those targets cannot take are one line before the model loads."""

from __future__ import annotations

import json
import math

import pytest
import torch

import dflash_train.target.attn_impl as attn_impl
import dflash_train.train.setup as setup_mod
from dflash_train.cli import main
from dflash_train.data.prompts import asset_path
from dflash_train.target.language_model import find_decoder_layers
from dflash_train.target.packed import SUPPORTED_MODEL_TYPES as PACKED_MODEL_TYPES
from dflash_train.train.config import TrainConfig
from dflash_train.train.trainer import Trainer
from dflash_train.utils.config import load_config

from ..conftest import ON_CPU, prepare_dataset, synthetic_conversations
from ..family_dirs import save_tiny_family

DEMO = asset_path("demo_cpu.yaml")
FAMILIES = ("gemma2", "gpt_oss", "gemma3")


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory):
    """{family: (target dir, prepared dataset)} of the tiny targets, saved like user checkpoints."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name in FAMILIES:
        save_tiny_family(name, root / name)
        out[name] = (root / name, prepare_dataset(root / name, synthetic_conversations(40), root / f"{name}-data"))
    return out


def demo_overrides(target, data, out, **extra) -> dict:
    return {"target.path": str(target), "data.path": str(data), "run.output_dir": str(out), "run.max_steps": "2",
            "run.progress": "false", **ON_CPU, **extra}


def cli_args(overrides: dict) -> list[str]:
    return ["train", "--config", str(DEMO), *(a for k, v in overrides.items() for a in (f"--{k}", str(v)))]


@pytest.mark.parametrize("name", FAMILIES)
def test_train_with_default_options(name, family_runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(attn_impl, "_announced", set())  # as in a fresh process: nothing said yet
    target, data = family_runs[name]
    assert main(cli_args(demo_overrides(target, data, tmp_path / "run"))) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    assert sorted(train) == [2] or sorted(train) == [1, 2]
    assert math.isfinite(train[2]["loss"]) and train[2]["labels"] > 0
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    said = [line for line in capsys.readouterr().err.splitlines() if "attention, as it does not support sdpa" in line]
    assert len(said) == (0 if name == "gemma3" else 1), said  # eager said once (the check before the load)


def test_gemma3_wrapper_taps_its_text_layers(family_runs, tmp_path):
    target, data = family_runs["gemma3"]
    cfg = load_config(TrainConfig, DEMO, demo_overrides(target, data, tmp_path / "run",
                                                        **{"drafter.target_layer_ids": "0,1,2"}))
    assert cfg.step.label_source == "target"  # the demo's: the final norm is needed
    trainer = Trainer(cfg)
    model, runner = trainer.target.model, trainer.target.runner
    text = model.model.language_model
    assert runner.layers is text.layers and runner.final_norm is text.norm
    ids = torch.randint(0, 290, (1, 21), generator=torch.Generator().manual_seed(0))
    out = runner(ids, torch.arange(21)[None], torch.zeros(1, 21, dtype=torch.long), need_final=True)
    runner.close()  # its hooks would stop the reference forward
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True)
    H = text.config.hidden_size
    for j, layer in enumerate((0, 1, 2)):
        torch.testing.assert_close(out.taps[..., j * H:(j + 1) * H], ref.hidden_states[layer + 1], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.final_hidden @ model.lm_head.weight.T, ref.logits, rtol=0, atol=1e-4)


def test_gemma2_heads_carry_the_logit_cap_whole_or_split(family_runs, tmp_path):
    target, data = family_runs["gemma2"]
    cfg = load_config(TrainConfig, DEMO, demo_overrides(target, data, tmp_path / "run",
                                                        **{"step.label_source": "distill"}))
    d = setup_mod.resolve_drafter_config(cfg, setup_mod.read_target_config(str(target)), None)
    whole = setup_mod.load_frozen_target(cfg, d, torch.device("cpu"), whole_model=True)
    heads_only = setup_mod.load_frozen_target(cfg, d, torch.device("cpu"), whole_model=False)  # a split drafter rank
    assert whole.heads.logit_softcap == heads_only.heads.logit_softcap == 30.0
    assert whole.model.config._attn_implementation == "eager"
    assert torch.equal(whole.heads.lm_head_weight, heads_only.heads.lm_head_weight)
    assert len(find_decoder_layers(whole.model)) == 4


def test_packed_forward_on_a_family_it_does_not_take_is_one_line_before_it_loads(family_runs, tmp_path, capsys,
                                                                                  refuse_models):
    _, data = family_runs["gemma2"]
    target = tmp_path / "lfm2"
    save_tiny_family("lfm2", target)  # short convolutions between attention layers: the Hugging Face forward only
    assert main(cli_args(demo_overrides(target, data, tmp_path / "run", **{"target.forward": "packed"}))) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-train train: error")]
    assert len(err) == 1 and err[0].startswith(
        f"dflash-train train: error: target.forward=packed: the packed target forward supports "
        f"{', '.join(PACKED_MODEL_TYPES)} decoders, not 'lfm2'; use target.forward: hf for this model"), err


@pytest.mark.parametrize("extra, message", [
    ({"target.attn_implementation": "sdpa"},
     "dflash-train train: error: the target's model type gemma2 (Gemma2ForCausalLM) does not support "
     "attn_implementation sdpa (it soft-caps its attention scores, which sdpa cannot): use "
     "--target.attn_implementation with one of auto, eager"),
    ({"target.sdpa_backend": "flash"},
     "dflash-train train: error: target.sdpa_backend=flash forces an SDPA kernel, but the target (gemma2) runs "
     "eager attention, not sdpa: set target.sdpa_backend: auto, or target.forward: packed"),
])
def test_options_gemma2_cannot_take_are_one_line_before_it_loads(extra, message, family_runs, tmp_path, capsys,
                                                                 refuse_models):
    target, data = family_runs["gemma2"]
    assert main(cli_args(demo_overrides(target, data, tmp_path / "run", **extra))) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflash-train train: error")]
    assert len(err) == 1 and err[0].startswith(message), err
