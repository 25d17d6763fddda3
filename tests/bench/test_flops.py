"""The MFU numerator and denominator of `dflash-train bench`: counted against the modules
themselves, and the FP8-aware utilisation against its definition."""

import itertools
import json
from fractions import Fraction

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from dflash_train.bench.cli import BenchConfig, build_config, model_flops_utilisation, run
from dflash_train.bench.flops import (best_peaks, causal_pairs_per_layer, expected_label_rows, mlp_flops_per_token,
                                      step_flops)
from dflash_train.target.presets import preset_config
from dflash_train.target.runner import find_decoder_layers
from dflash_train.utils.errors import TrainingError


def _router(mixture: nn.Module) -> nn.Module:
    return getattr(mixture, "gate", None) or mixture.router  # (gpt-oss calls it router)


def _routed_flops(mixture: nn.Module, top_k: int) -> int:
    """Per token: the router's [E, H] matmul, and top_k of the E experts' 3D gate_up and down (either
    orientation: per expert, in x out numbers each)."""
    gate_up, down = mixture.experts.gate_up_proj, mixture.experts.down_proj
    per_expert = gate_up.shape[1] * gate_up.shape[2] + down.shape[1] * down.shape[2]
    return 2 * _router(mixture).weight.numel() + 2 * per_expert * top_k


@pytest.mark.parametrize("preset", ["tiny", "qwen3-8b", "gemma3-27b", "qwen3.5-27b", "qwen3-30b-a3b", "mixtral-8x7b",
                                    "glm4.5-air", "glm4.7-flash", "qwen3.5-35b-a3b", "gpt-oss-20b"])
def test_target_linear_flops_count_every_decoder_matmul(tmp_path, preset):
    """2 * in * out per token for every nn.Linear of every decoder layer the target runs (latent
    attention's five projections, a linear-attention layer's, shared experts and their gates), and
    for a mixture the router and the top-k experts' 3D weights: read off a model built from the
    preset (on the meta device)."""
    cfg = build_config(BenchConfig(preset=preset, tokens=256, doc_len="40-120", device="cpu"), tmp_path)
    config = preset_config(f"preset:{preset}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    brute = 0
    for layer in find_decoder_layers(model):
        mixtures = [m for m in layer.modules() if hasattr(m, "experts") and (hasattr(m, "gate") or hasattr(m, "router"))]
        routed = {id(p) for m in mixtures for p in m.experts.parameters()}
        brute += sum(2 * m.in_features * m.out_features for m in layer.modules()
                     if isinstance(m, nn.Linear) and id(m.weight) not in routed)
        brute += sum(_routed_flops(m, config.num_experts_per_tok) for m in mixtures)
    assert step_flops(cfg, preset)["target_linear"] == brute


def test_utilisation_without_fp8_is_achieved_over_the_bf16_peak():
    flops = {"per_token": 30e9, "target_linear": 20e9}
    assert model_flops_utilisation(flops, 10_000, {"bf16": 750.0}) == pytest.approx(30e9 * 1e4 / 750e12)
    assert model_flops_utilisation(flops, 10_000, None) is None


def test_utilisation_with_fp8_counts_the_target_matmuls_at_the_fp8_peak():
    """20 GFLOP at 1,500 TFLOP/s + 10 GFLOP at 750 = 26.67 us per token ideal; at 30K tok/s
    a token takes 33.3 us: 80%. Against the bf16 peak alone it would read 120%."""
    flops = {"per_token": 30e9, "target_linear": 20e9}
    mfu = model_flops_utilisation(flops, 30_000, {"bf16": 750.0, "fp8": 1500.0})
    assert mfu == pytest.approx((20e9 / 1500e12 + 10e9 / 750e12) * 30_000)
    assert mfu == pytest.approx(0.8)


def test_the_peak_is_the_best_measured_before_and_after_the_run():
    """A GPU whose clocks sat lower after a heavy run measured 678 TFLOP/s then, 789 before: the
    MFU is taken against 789, each kind (bf16, fp8) on its own; nothing measured (a CPU) is None."""
    assert best_peaks({"bf16": 789.0}, {"bf16": 678.0}) == {"bf16": 789.0}
    assert best_peaks({"bf16": 700.0, "fp8": 1500.0}, {"bf16": 780.0, "fp8": 1400.0}) == {"bf16": 780.0, "fp8": 1500.0}
    assert best_peaks(None, {"bf16": 750.0}) == {"bf16": 750.0}
    assert best_peaks(None, None) is None


def test_a_run_takes_the_better_of_its_peaks_and_a_lever_table_its_own(monkeypatch):
    from dflash_train.bench import cli

    monkeypatch.setattr(cli, "matmul_peaks_tflops",
                        lambda device, fp8=False: {"bf16": 678.0, **({"fp8": 1300.0} if fp8 else {})})
    cpu, bf16, fp8 = torch.device("cpu"), BenchConfig(preset="tiny"), BenchConfig(preset="tiny", fp8_target=True)
    assert cli.run_peaks(bf16, cpu, None, {"bf16": 789.0}) == {"bf16": 789.0}  # measured after: lower
    assert cli.run_peaks(fp8, cpu, None, {"bf16": 600.0, "fp8": 1500.0}) == {"bf16": 678.0, "fp8": 1500.0}
    table = {"bf16": 760.0, "fp8": 1450.0}  # a lever table's, measured once before its rows
    assert cli.run_peaks(bf16, cpu, table, None) == {"bf16": 760.0}  # the float8 peak only for an FP8 row
    assert cli.run_peaks(fp8, cpu, table, None) == table
    assert cli.run_peaks(fp8, cpu, {"bf16": 760.0}, None) == {"bf16": 678.0, "fp8": 1300.0}  # no fp8 given: measured


def test_bench_profile_records_three_steps_after_the_measured_ones(tmp_path):
    """`--profile`: a kernel table of 3 steps run after the measured ones, beside the JSON."""
    out = tmp_path / "bench.json"
    assert run(BenchConfig(preset="tiny", tokens=256, doc_len="40-120", anchors=8, block=4, layers=1, warmup=1,
                           measure=2, device="cpu", profile=True, out=str(out), set=["loss.chunk_rows=64"])) == 0
    assert json.loads(out.read_text())["overrides"] == ["loss.chunk_rows=64"]  # what the row ran with
    table = (tmp_path / "bench.kernels.txt").read_text()
    assert table.startswith("torch.profiler over optimizer steps 4-6")
    row = [ln.split() for ln in table.splitlines() if ln.strip().startswith("train_step ")]
    assert int(row[0][-1]) == 3
    with pytest.raises(ValueError, match="--profile"):
        BenchConfig(preset="tiny", levers="baseline", profile=True)


@pytest.mark.parametrize("C,n,B", [(9, 3, 4), (10, 1, 5), (8, 8, 3), (12, 5, 16), (7, 2, 2), (6, 9, 4)])
def test_expected_label_rows_is_the_mean_over_every_anchor_draw(C, n, B):
    """Every draw of min(n, C) anchors of C candidates, equally likely: the mean count of
    distinct positions a + k - 1 (k = 1..B-1) inside the candidate range."""
    draws = list(itertools.combinations(range(C), min(n, C)))
    total = sum(len({a + k - 1 for a in draw for k in range(1, B) if a + k - 1 < C}) for draw in draws)
    assert expected_label_rows(C, n, B) == pytest.approx(float(Fraction(total, len(draws))), rel=1e-12)


def test_bench_stopped_before_its_measured_steps_says_so(tmp_path):
    """A run cut short (here run.max_minutes; on a GPU box a timeout's SIGTERM) has no measured
    window: a clear error naming the steps, not a missing-file traceback."""
    out = tmp_path / "bench.json"
    with pytest.raises(TrainingError, match=r"stopped at step 1 .* measured steps 2-3 were done"):
        run(BenchConfig(preset="tiny", tokens=256, doc_len="40-120", anchors=8, block=4, layers=1, warmup=1,
                        measure=2, device="cpu", out=str(out), set=["run.max_minutes=1e-9"]))
    assert not out.exists()


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "qwen3_next", "gpt_oss", "glm4_moe", "deepseek_v3",
                                    "qwen3_5_moe", "minimax_m2"])
@pytest.mark.parametrize("which", ["first", "last"])
def test_mlp_flops_per_token_equal_the_matmuls_a_layer_runs(family, which):
    """A mixture of experts counts the router and the experts each token is routed to (and the
    shared experts): the matmul FLOPs torch's counter sees in one layer's MLP (experts run
    eagerly: only routed tokens are multiplied); GLM's and DeepSeek's first layer is dense."""
    from torch.utils.flop_counter import FlopCounterMode

    from tests.families import build_model

    model = build_model(family, 300)
    model.config._experts_implementation = "eager"
    index = 0 if which == "first" else model.config.num_hidden_layers - 1
    layer = find_decoder_layers(model)[index]
    h = torch.randn(1, 37, model.config.hidden_size)
    with FlopCounterMode(display=False) as counter:
        layer.mlp(h)
    assert mlp_flops_per_token(model.config, index) * 37 == counter.get_total_flops()


def test_sliding_window_pairs_count_the_keys_each_query_sees():
    """Brute force: keys k <= q with q - k < W for sliding layers, k <= q for full ones."""
    cfg = preset_config("preset:gpt-oss-20b")
    L, W = 300, cfg.sliding_window
    q, k = torch.arange(L)[:, None], torch.arange(L)[None, :]
    full, window = int((k <= q).sum()), int(((k <= q) & (q - k < W)).sum())
    assert causal_pairs_per_layer(cfg, L, 4) == 2 * full + 2 * window  # sliding, full, sliding, full
    assert causal_pairs_per_layer(preset_config("preset:qwen3-8b"), L, 3) == 3 * full
