"""`auto` picks the fast path by itself (train/setup.py: resolve_fast_path), and what a run folder
holds is never lost: a hand-edited config.yaml, a folder a failed start made."""

from __future__ import annotations

import pytest
import torch
import yaml
from transformers import Gemma3Config, Gemma3TextConfig, LlamaConfig, MambaConfig

from dflash_train.cli import main
from dflash_train.target.packed import UnsupportedTarget, check_packed_config
from dflash_train.train.config import TrainConfig
from dflash_train.train.setup import resolve_fast_path
from dflash_train.utils.config import load_config
from dflash_train.utils.errors import ConfigError

CPU, GPU = torch.device("cpu"), torch.device("cuda:0")  # only the device's type is read: no GPU needed
LLAMA = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100)
MAMBA = MambaConfig(hidden_size=64, num_hidden_layers=4, vocab_size=100)  # no attention: never the packed forward's
GEMMA3 = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=100, sliding_window=32)


def _why_not_packed(config) -> str:
    with pytest.raises(UnsupportedTarget) as exc:
        check_packed_config(config)
    return str(exc.value).split(";")[0]


def _cfg(**overrides) -> TrainConfig:
    return load_config(TrainConfig, None, {"data.path": "d", **overrides})


def _fast(cfg: TrainConfig) -> tuple:
    return cfg.target.forward, cfg.target.compile, cfg.run.compile, cfg.run.drafter_dtype


def test_auto_is_the_packed_compiled_bf16_path_on_a_gpu_and_the_plain_one_on_a_cpu():
    cfg, line = resolve_fast_path(_cfg(), LLAMA, GPU)
    assert _fast(cfg) == ("packed", True, True, "bfloat16")
    assert line == ("auto settings: target.forward packed, target.compile true, target.grouped_kv false, "
                    "run.compile true, run.drafter_dtype "
                    "bfloat16 (the fast path on cuda:0; set any of them to choose)")
    cfg, line = resolve_fast_path(_cfg(), LLAMA, CPU)
    assert _fast(cfg) == ("hf", False, False, "float32")
    assert line == ("auto settings: target.forward hf, target.compile false, target.grouped_kv false, "
                    "run.compile false, run.drafter_dtype "
                    "float32 (on a CPU the uncompiled float32 path: compiling pays only on a GPU; set any of them "
                    "to choose)")


def test_a_family_the_packed_forward_does_not_take_keeps_the_hf_forward_and_says_why():
    why = _why_not_packed(MAMBA)
    assert "mamba" in why
    cfg, line = resolve_fast_path(_cfg(), MAMBA, GPU)
    assert _fast(cfg) == ("hf", False, True, "bfloat16")
    assert line == ("auto settings: target.forward hf, target.compile false, target.grouped_kv false, "
                    "run.compile true, run.drafter_dtype "
                    f"bfloat16 (on cuda:0; the Hugging Face target forward, since the packed one does not take this "
                    f"target ({why}); set any of them to choose)")
    with pytest.raises(ConfigError) as exc:
        resolve_fast_path(_cfg(**{"target.compile": "true"}), MAMBA, GPU)
    assert str(exc.value) == (f"target.compile: true needs the packed target forward, and it does not take this "
                              f"target ({why}); set target.compile false")


def test_auto_gives_gemma_grouped_keys_on_the_packed_forward_only():
    """Gemma's windowed FlexAttention layers read one key/value head per group of query heads
    (target.grouped_kv auto): on wherever the packed forward runs it, a multimodal checkpoint's text
    stack included; off on the Hugging Face forward, with the kernel that takes no grouped keys,
    on other families, and where the config says so."""
    def grouped(config, device=GPU, **overrides) -> bool:
        return resolve_fast_path(_cfg(**overrides), config, device)[0].target.grouped_kv

    assert grouped(GEMMA3) is True and grouped(Gemma3Config(text_config=GEMMA3.to_dict())) is True
    cfg, line = resolve_fast_path(_cfg(), GEMMA3, GPU)
    assert "target.compile true, target.grouped_kv true, run.compile" in line
    assert grouped(GEMMA3, CPU) is False  # the Hugging Face forward: auto on a CPU
    assert grouped(GEMMA3, CPU, **{"target.forward": "packed"}) is True
    assert grouped(GEMMA3, **{"target.forward": "hf"}) is False
    assert grouped(GEMMA3, **{"target.sdpa_backend": "efficient"}) is False
    assert grouped(GEMMA3, **{"target.grouped_kv": "false"}) is False
    assert grouped(LLAMA) is False and grouped(LLAMA, **{"target.grouped_kv": "true"}) is True
    assert resolve_fast_path(_cfg(**{"target.grouped_kv": "false"}), GEMMA3, GPU)[1].count("grouped_kv") == 0


def test_a_target_sharded_over_a_group_gets_the_fast_path_too():
    """The packed forward gathers each layer's weights itself (target/gathered.py), so a sharded
    target (pipeline.target_group_size > 1) gets the same choice as a whole one; the Hugging
    Face forward stays one setting away."""
    group = {"pipeline.layout": "colocated", "pipeline.target_group_size": "2"}
    cfg, line = resolve_fast_path(_cfg(**group), LLAMA, GPU)
    assert _fast(cfg) == ("packed", True, True, "bfloat16")
    assert line == resolve_fast_path(_cfg(), LLAMA, GPU)[1]
    cfg, _ = resolve_fast_path(_cfg(**group, **{"target.forward": "hf"}), LLAMA, GPU)
    assert _fast(cfg) == ("hf", False, True, "bfloat16")


def test_explicit_values_are_kept_and_not_announced():
    explicit = _cfg(**{"target.forward": "hf", "target.compile": "false", "target.grouped_kv": "false",
                       "run.compile": "false", "run.drafter_dtype": "float32"})
    assert resolve_fast_path(explicit, LLAMA, GPU) == (explicit, None)
    cfg, line = resolve_fast_path(_cfg(**{"run.drafter_dtype": "float32"}), LLAMA, GPU)
    assert _fast(cfg) == ("packed", True, True, "float32") and "drafter_dtype" not in line


def test_a_compiled_target_asked_for_on_a_cpu_takes_the_packed_forward_where_it_can():
    cfg, line = resolve_fast_path(_cfg(**{"target.compile": "true"}), LLAMA, CPU)
    assert _fast(cfg) == ("packed", True, False, "float32") and "target.forward packed" in line
    with pytest.raises(ConfigError, match=r"target.compile: true needs the packed target forward, and it does not "
                                          r"take this target \(.*mamba.*\); set target.compile false"):
        resolve_fast_path(_cfg(**{"target.compile": "true"}), MAMBA, CPU)
    with pytest.raises(ConfigError, match="target.compile needs target.forward: packed"):  # explicit: at load
        _cfg(**{"target.compile": "true", "target.forward": "hf"})


def test_autotune_without_a_compiled_drafter_is_refused_where_auto_turns_compile_off():
    cfg = _cfg(**{"run.compile_autotune": "true"})
    assert resolve_fast_path(cfg, LLAMA, GPU)[0].run.compile is True
    with pytest.raises(ConfigError, match="run.compile_autotune needs run.compile, which auto turns off on a CPU"):
        resolve_fast_path(cfg, LLAMA, CPU)


def _train_args(tiny_targets, tiny_datasets, out, *extra) -> list[str]:
    return ["train", "--target.path", str(tiny_targets["llama"]), "--data.path", str(tiny_datasets["llama"]),
            "--run.output_dir", str(out), "--run.device", "cpu", "--run.max_steps", "2", "--run.save_every", "2",
            "--no-run.progress", "--no-run.tensorboard", "--data.plan.token_budget", "256", "--drafter.num_layers",
            "1", "--drafter.block_size", "4", "--step.num_anchors", "8", "--eval.spec_prompts", "null", *extra]


def test_a_run_says_and_saves_what_auto_chose(tiny_targets, tiny_datasets, tmp_path, capsys):
    assert main(_train_args(tiny_targets, tiny_datasets, tmp_path / "run")) == 0
    assert ("auto settings: target.forward hf, target.compile false, target.grouped_kv false, run.compile false"
            in capsys.readouterr().err)
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (saved["target"]["forward"], saved["target"]["compile"], saved["run"]["compile"],
            saved["run"]["drafter_dtype"]) == ("hf", False, False, "float32")


def test_a_hand_edited_run_config_is_kept_when_a_resume_rewrites_it(tiny_targets, tiny_datasets, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(_train_args(tiny_targets, tiny_datasets, run)) == 0
    edited = (run / "config.yaml").read_text().replace("lr: 0.0006", "lr: 0.003")
    (run / "config.yaml").write_text(edited)
    capsys.readouterr()
    assert main([*_train_args(tiny_targets, tiny_datasets, run), "--resume", "--run.max_steps", "3"]) == 0
    assert (run / "config.yaml.edited").read_text() == edited  # the user's version: kept, byte for byte
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == 0.0006  # what the run used
    assert (f"{run}/config.yaml was edited (optim.lr) and this run does not take those values: a run reads its "
            f"config from --config and the options, not from its folder; the edited file is kept as "
            f"config.yaml.edited") in capsys.readouterr().err
    # the edited file given as --config: its values are the run's, nothing to keep aside
    (run / "config.yaml").write_text(edited.replace("max_steps: 3", "max_steps: 4"))
    assert main(["train", "--config", str(run / "config.yaml"), "--resume"]) == 0
    assert sorted(p.name for p in run.glob("config.yaml*")) == ["config.yaml", "config.yaml.edited"]
    assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == 0.003


def test_a_rank_above_the_vocabulary_is_one_line_and_leaves_no_folder(tiny_targets, tiny_datasets, tmp_path, capsys,
                                                                        refuse_models):
    out = tmp_path / "run"
    assert main(_train_args(tiny_targets, tiny_datasets, out, "--drafter.variant", "dspark",
                            "--drafter.markov_rank", "2000000000")) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        "dflash-train train: error: the drafter section does not fit the target "
        f"{tiny_targets['llama']}: markov_rank (drafter.markov_rank) 2,000,000,000 is above the vocabulary size "
        "300: the bigram head's tables are [vocab, rank], and a rank above the vocabulary adds nothing")
    assert "Traceback" not in err
    assert not out.exists()  # the folder this start made (it held only its lock) is gone
