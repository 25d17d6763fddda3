"""`attn_implementation`: auto takes sdpa where the model class supports it and eager elsewhere
(Gemma 2, gpt-oss), decided before the load; an explicit choice the model does not support, or a
load transformers refuses for its attention, is one line naming the option."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

import dflash_train.target.attn_impl as attn_impl
from dflash_train.target.attn_impl import (attention_load_error, causal_lm_class, resolve_attn_implementation,
                                           supported_attn_implementations)
from dflash_train.target.config import TargetConfig
from dflash_train.target.loading import load_causal_lm, load_target_model
from dflash_train.target.runner import TargetRunner
from dflash_train.utils.errors import ModelError
from tests.families import FAMILIES

from ..family_dirs import save_tiny_family

VOCAB = 300
# written out by hand: the families whose transformers class has no sdpa attention, or that soft-cap
# attention scores (Gemma 2: 5.17's class claims sdpa and would drop the cap)
EAGER_FAMILIES = {"gemma2", "gpt_oss"}


@pytest.fixture(autouse=True)
def fresh_announcements(monkeypatch):
    monkeypatch.setattr(attn_impl, "_announced", set())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_auto_is_sdpa_where_supported_else_eager(name):
    config = FAMILIES[name].config(VOCAB)
    expected = "eager" if name in EAGER_FAMILIES else "sdpa"
    assert resolve_attn_implementation(config, "auto") == expected
    assert resolve_attn_implementation(config, None) == expected
    assert resolve_attn_implementation(config, "eager") == "eager"  # every class runs eager


def test_the_class_is_the_one_the_auto_class_builds():
    assert causal_lm_class(FAMILIES["gemma3"].config(VOCAB)).__name__ == "Gemma3ForConditionalGeneration"
    assert causal_lm_class(FAMILIES["gemma2"].config(VOCAB)).__name__ == "Gemma2ForCausalLM"
    config = FAMILIES["llama"].config(VOCAB)
    config.auto_map = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
    assert causal_lm_class(config, trust_remote_code=True) is None  # only its own code knows
    assert resolve_attn_implementation(config, "auto", trust_remote_code=True) is None  # transformers decides
    assert resolve_attn_implementation(config, "eager", trust_remote_code=True) == "eager"


def test_attention_soft_capping_rules_out_sdpa_whatever_the_class_says():
    class ClaimsSdpa:  # transformers 5.17's Gemma2ForCausalLM
        _supports_sdpa, _supports_flash_attn, _supports_flex_attn = True, True, True

    gemma2 = FAMILIES["gemma2"].config(VOCAB)
    assert supported_attn_implementations(ClaimsSdpa, gemma2) == ["eager", "flash_attention_2", "flex_attention"]
    gemma2.attn_logit_softcapping = None
    assert supported_attn_implementations(ClaimsSdpa, gemma2) == ["sdpa", "eager", "flash_attention_2",
                                                                 "flex_attention"]


@pytest.mark.parametrize("name, cls", [("gemma2", "Gemma2ForCausalLM"), ("gpt_oss", "GptOssForCausalLM")])
def test_explicit_sdpa_on_a_model_without_it_names_the_model_and_the_choices(name, cls):
    with pytest.raises(ModelError) as err:
        resolve_attn_implementation(FAMILIES[name].config(VOCAB), "sdpa", option="target.attn_implementation")
    message = str(err.value)
    assert message.startswith(f"the target's model type {name} ({cls}) does not support attn_implementation sdpa")
    assert ": use --target.attn_implementation with one of auto, eager" in message
    assert "\n" not in message and "sdpa," not in message.split("one of")[1]
    assert ("soft-caps its attention scores" in message) == (name == "gemma2")


def test_auto_is_logged_once_and_only_when_not_sdpa(caplog):
    with caplog.at_level(logging.INFO, logger="dflash_train.target.attn_impl"):
        for _ in range(2):
            resolve_attn_implementation(FAMILIES["gpt_oss"].config(VOCAB), "auto")
            resolve_attn_implementation(FAMILIES["qwen3"].config(VOCAB), "auto")
    assert [r.getMessage() for r in caplog.records] == [
        "target gpt_oss (GptOssForCausalLM): eager attention, as it does not support sdpa"]


@pytest.mark.parametrize("name, expected", [("gemma2", "eager"), ("gpt_oss", "eager"), ("qwen3", "sdpa"),
                                            ("gemma3", "sdpa")])
def test_a_loaded_target_runs_the_resolved_attention_and_taps_as_eager_does(name, expected, tmp_path):
    """The loaded target's taps equal those of the same weights under eager attention (5.17 would
    run Gemma 2 under sdpa without its attention soft-cap, and these would differ)."""
    reference, _ = save_tiny_family(name, tmp_path)
    model = load_causal_lm(tmp_path, dtype=torch.float32)
    assert model.config._attn_implementation == expected
    ids = torch.randint(0, VOCAB - 8, (1, 17), generator=torch.Generator().manual_seed(0))
    assert reference.config._attn_implementation == ("sdpa" if name == "gemma3" else "eager")  # tests/families.py
    runners = [TargetRunner(m, [0, 2]) for m in (model, reference)]
    (got, _), (want, _) = (r.run_documents(ids, torch.tensor([17])) for r in runners)
    for r in runners:
        r.close()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5)


def test_an_unsupported_choice_is_refused_before_the_weights_load(tmp_path, monkeypatch):
    save_tiny_family("gpt_oss", tmp_path)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: pytest.fail("the weights loaded before the choice was checked"))
    with pytest.raises(ModelError, match=r"model type gpt_oss .* use --attn-implementation with one of auto, eager"):
        load_causal_lm(tmp_path, attn_implementation="sdpa", attn_option="attn-implementation")
    with pytest.raises(ModelError, match=r"use --target.attn_implementation with one of auto, eager"):
        load_target_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"), attn_implementation="sdpa")


def test_a_load_refused_for_its_attention_names_eager(tmp_path, monkeypatch):
    save_tiny_family("qwen3", tmp_path)
    flash = ImportError("FlashAttention2 has been toggled on, but it cannot be used due to the following error: "
                        "the package flash_attn seems to be not installed.\nPlease refer to the documentation.")

    def refuse(*a, **k):
        assert k["attn_implementation"] == "flash_attention_2"
        raise flash

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    with pytest.raises(ModelError) as err:
        load_target_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"),
                          attn_implementation="flash_attention_2")
    assert str(err.value) == (
        f"{tmp_path}: transformers cannot load it with attn_implementation flash_attention_2 (FlashAttention2 has "
        f"been toggled on, but it cannot be used due to the following error: the package flash_attn seems to be "
        f"not installed.); use --target.attn_implementation eager")
    other = ValueError("Unable to load weights from safetensors file")  # not about attention: left alone
    assert attention_load_error(other, "sdpa", "x") is None
    assert attention_load_error(flash, "eager", "x") is None  # eager is the advice: it cannot be the cause


def test_target_config_defaults_to_auto_and_an_sdpa_kernel_needs_sdpa_or_auto():
    assert TargetConfig().attn_implementation == "auto"
    TargetConfig(sdpa_backend="flash")  # auto: checked against the model once it is known
    with pytest.raises(ValueError, match="target.sdpa_backend=flash needs target.attn_implementation: sdpa"):
        TargetConfig(sdpa_backend="flash", attn_implementation="eager", forward="hf")
    TargetConfig(sdpa_backend="flash", attn_implementation="eager")  # forward auto: checked once it is decided


def test_eval_refuses_an_unsupported_choice_in_one_line_before_the_target_loads(tmp_path, monkeypatch, capsys):
    import dflash_train.eval.cli as eval_cli
    from dflash_train.cli import main
    from dflash_train.drafter.checkpoint import save_drafter
    from dflash_train.drafter.config import drafter_config_from_target
    from dflash_train.drafter.model import DFlashDrafter
    from dflash_train.eval.cli import EvalJobConfig
    from dflash_train.utils.config import load_config
    from dflash_train.utils.errors import ConfigError

    assert load_config(EvalJobConfig, None, {"drafter": "d"}).attn_implementation == "auto"
    with pytest.raises(ConfigError, match="attn_implementation"):
        load_config(EvalJobConfig, None, {"drafter": "d", "attn_implementation": "fast"})
    model, tok = save_tiny_family("gemma2", tmp_path / "target")
    drafter = DFlashDrafter(drafter_config_from_target(model.config, mask_token_id=len(tok), num_hidden_layers=1,
                                                       block_size=4))
    save_drafter(drafter, tmp_path / "drafter")
    capsys.readouterr()  # the saves' progress bars
    monkeypatch.setattr(eval_cli, "load_causal_lm", lambda *a, **k: pytest.fail("eval loaded the target first"))
    assert main(["eval", "--target", str(tmp_path / "target"), "--drafter", str(tmp_path / "drafter"),
                 "-o", str(tmp_path / "report"), "--attn-implementation", "sdpa", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "dflash-train eval: error: the target's model type gemma2 (Gemma2ForCausalLM) does not support "
        "attn_implementation sdpa (it soft-caps its attention scores, which sdpa cannot): use "
        "--attn-implementation with one of auto, eager"), err


@pytest.mark.parametrize("option, expected", [(None, "sdpa"), ("eager", "eager"), ("flash_attention_2", None)])
def test_generate_loads_with_the_option_and_names_it_when_the_load_is_refused(option, expected, tmp_path,
                                                                             monkeypatch, capsys):
    from dflash_train.cli import main
    from dflash_train.generate.config import GenerateConfig
    from dflash_train.utils.config import load_config

    assert load_config(GenerateConfig, None, {"output": "o.jsonl", "synthesize": "1"}).attn_implementation == "auto"
    save_tiny_family("qwen3", tmp_path / "target")
    capsys.readouterr()
    asked = []

    def load(*a, **k):  # stands in for the weights: what it was asked is the point
        asked.append(k["attn_implementation"])
        if k["attn_implementation"] == "flash_attention_2":  # as transformers says it without flash-attn
            raise ImportError("FlashAttention2 has been toggled on, but it cannot be used due to the following "
                              "error: the package flash_attn seems to be not installed.")
        raise RuntimeError("stop here")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", load)
    args = ["generate", "--target", str(tmp_path / "target"), "--synthesize", "1", "--output",
            str(tmp_path / "gen.jsonl"), "--device", "cpu", "--no-progress"]
    if option:
        args += ["--attn-implementation", option]
    if expected:
        with pytest.raises(RuntimeError, match="stop here"):
            main(args)
        assert asked == [expected]
        return
    assert main(args) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith("dflash-train generate: error: ") and \
        err[0].endswith("; use --attn-implementation eager"), err


@pytest.mark.parametrize("fla_installed", [True, False])
def test_a_hybrid_target_says_once_which_kernels_its_linear_attention_runs(monkeypatch, caplog, fla_installed):
    import importlib.util
    import logging

    from dflash_train.target import attn_impl

    monkeypatch.setattr(attn_impl, "_announced", set())
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if fla_installed else None) if name == "fla" else real_find_spec(name, *a))
    with caplog.at_level(logging.INFO, logger=attn_impl.__name__):
        for _ in range(2):
            resolve_attn_implementation(FAMILIES["qwen3_5"].config(VOCAB), "auto")
        resolve_attn_implementation(FAMILIES["llama"].config(VOCAB), "auto")
    lines = [r.getMessage() for r in caplog.records if "linear-attention" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("target qwen3_5_text: ")
    assert ("layers run flash-linear-attention's kernels" in lines[0]) is fla_installed
    assert ("pip install -e '.[fla]'" in lines[0]) is not fla_installed
