"""A target sharded over a group of ranks (pipeline.target_group_size): real gloo processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dflash_train.pipeline.config import PipelineConfig
from dflash_train.target.sharded import shard_rows
from dflash_train.train.checkpoint import latest_checkpoint

from ..conftest import prepare_dataset, synthetic_conversations
from ..family_dirs import save_fp8_family
from ..families import save_family
from .test_pipeline import (  # noqa: F401 (the fixture ends a failed test's jobs)
    _direct, _wait_for_checkpoint, finish, losses, no_job_outlives_its_test, run, single)

WORKER = Path(__file__).with_name("sharded_worker.py")
NAMES = ("qwen3", "qwen3_moe", "qwen2", "gemma3_text", "gpt_oss", "glm4_moe", "mixtral", "deepseek_v3", "qwen3_5_moe")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-families")
    for name in NAMES:
        save_family(name, root / name)
    return root


@pytest.mark.parametrize("world", [2, 4])
def test_every_tapped_layer_equals_the_whole_model_and_each_rank_holds_1_over_g(families, tmp_path, world):
    """Dense, MoE (GLM-4.5's and DeepSeek-V3's router bias is a buffer read whole from the files;
    Mixtral's experts saved one tensor each under its original module names), latent attention
    (DeepSeek-V3), a hybrid (Qwen3.5-MoE: linear attention, gated shared experts), tied-embedding, windowed (Gemma 3) and
    sink (gpt-oss) targets sharded over 2 and
    4 gloo processes: every layer's output and the final norm's equal transformers' whole model on
    each rank's own documents (forwards that stop early too), and the packed forward, gathering
    each layer itself, equals the whole model's packed forward; a packed forward that raised inside
    a layer leaves nothing gathered. Each rank holds and reads 1/G of the parameter bytes, before
    and after forwards. A preset's random weights, drawn shard by shard, equal the preset built
    whole; with FP8 decoder linears, each rank quantising its rows, both equal the whole model
    converted to FP8."""
    targets = [str(families / name) for name in NAMES] + \
        ["preset:tiny", "fp8:" + str(families / "qwen3"), "fp8:preset:tiny"]
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={world}", "--standalone",
           str(WORKER), str(tmp_path), *targets]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for rank in range(world):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        for target in targets:
            r = report[target]
            assert r["sharded"]
            n = 6 if target.endswith("preset:tiny") else 4
            assert [len(d) for d in r["diffs"]] == [n + 1, n, n + 1]  # every layer (+ the final norm when asked)
            assert max(max(d) for d in r["diffs"]) <= 1e-5, (rank, target, r["diffs"])
            packed = r["packed"]
            assert [len(d) for d in packed["diffs"]] == [2, 1], target  # taps and final norm, then taps alone
            assert max(max(d) for d in packed["diffs"]) <= 1e-5, (rank, target, packed["diffs"])
            local, whole = r["bytes_loaded"]
            assert r["bytes_after"] == packed["bytes_after_error"] == r["bytes_loaded"]  # gathers all freed
            assert abs(local / whole - 1 / world) < 0.01, (rank, target, local, whole)
            if target.startswith("fp8:"):  # reads its rows in the checkpoint's dtype, holds them in float8
                assert r["read_bytes"] == 0 if "preset:" in target else \
                    abs(r["read_bytes"] / r["checkpoint_bytes"] - 1 / world) < 0.01
            else:
                # this rank's rows and no more, and the saved buffers whole (GLM's router bias)
                assert r["read_bytes"] == (0 if target == "preset:tiny" else local + r["buffer_bytes"])
                assert (r["buffer_bytes"] > 0) == target.endswith(("glm4_moe", "deepseek_v3"))


def test_a_block_fp8_checkpoint_is_dequantized_row_by_row_as_each_rank_reads_its_shard(tmp_path):
    """DeepSeek-V3's checkpoint layout (float8 weights, a float32 scale per 128 x 128 block) sharded
    over 3 gloo processes, so that shard rows start inside blocks: every layer equals the whole
    model transformers loads dequantized, on both forwards, and each rank holds 1/G of the bytes."""
    target = tmp_path / "fp8-target"
    save_fp8_family("qwen3", target)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "--standalone",
           str(WORKER), str(tmp_path), str(target)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    for rank in range(3):
        r = json.loads((tmp_path / f"rank-{rank}.json").read_text())[str(target)]
        assert r["sharded"] and max(max(d) for d in r["diffs"] + r["packed"]["diffs"]) <= 1e-5, (rank, r)
        local, whole = r["bytes_loaded"]
        assert abs(local / whole - 1 / 3) < 0.02, (rank, local, whole)


def test_shard_rows_are_fsdp_chunks():
    assert [shard_rows(10, r, 4) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [shard_rows(2, r, 4) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]


@pytest.mark.parametrize("fields, words", [
    ({"layout": "single", "target_group_size": 2}, "launch with torchrun"),
    ({"layout": "split", "target_ranks": 3, "drafter_ranks": 1, "target_group_size": 2}, "multiple of"),
    ({"layout": "split", "target_ranks": 4, "drafter_ranks": 1, "queue_depth": 2, "target_group_size": 4},
     "queue_depth (2) x pipeline.drafter_ranks (1) must be >= pipeline.target_group_size (4)"),
    ({"layout": "colocated", "overlap_target": True, "target_group_size": 2}, "overlap_target"),
])
def test_group_layouts_that_cannot_work_are_refused(fields, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        PipelineConfig(**fields)


@pytest.fixture(scope="module")
def setup(tiny_targets, tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded-runs")
    data = prepare_dataset(tiny_targets["qwen3"], synthetic_conversations(120, seed=1), root / "data")
    cfg = {"target": {"path": str(tiny_targets["qwen3"])}, "data": {"path": str(data), "plan": {"token_budget": 512}},
           "drafter": {"num_layers": 1, "block_size": 4}, "step": {"num_anchors": 16, "noise_sigma": 0.05},
           "optim": {"lr": 0.003, "warmup_steps": 2},
           "run": {"max_steps": 5, "log_every": 1, "save_every": 2, "progress": False, "tensorboard": False,
                   "device": "cpu"}}
    path = root / "base.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return root, path


GROUP2 = ("--pipeline.target_group_size", "2")


def test_training_with_a_sharded_target_equals_the_whole_target(setup):
    """Colocated x2 with one target shared by both ranks trains exactly as with a copy on each;
    split 2 + 1 with the two target ranks sharing one target (5 batches: in the last round one
    rank has none and joins the other's forward) exactly as one process, on the Hugging Face forward
    and on the packed one."""
    root, cfg = setup
    run(cfg, root / "colocated", 2)
    run(cfg, root / "colocated-g2", 2, *GROUP2)
    assert losses(root / "colocated-g2") == losses(root / "colocated")
    single(cfg, root / "single")
    split = ("--pipeline.layout", "split", "--pipeline.target_ranks", "2", "--pipeline.drafter_ranks", "1")
    run(cfg, root / "split-g2", 3, *split, *GROUP2)
    assert losses(root / "split-g2") == losses(root / "single")
    stats = json.loads((root / "split-g2" / "pipeline_stats.json").read_text())
    assert sorted(r["batches"] for r in stats["ranks"] if r["role"] == "target") == [2, 3]
    # the packed forward, each layer's weights gathered by the forward itself, the one-token join too
    packed = ("--target.forward", "packed")
    single(cfg, root / "single-packed", *packed)
    run(cfg, root / "split-g2-packed", 3, *split, *GROUP2, *packed)
    assert losses(root / "split-g2-packed") == losses(root / "single-packed")


@pytest.mark.parametrize("forward", ["hf", "packed"])
def test_a_killed_shard_rank_is_named_and_the_run_resumes(setup, forward):
    """Colocated x2 sharing one target, ranks started without torchrun: rank 1 SIGKILLed mid-run;
    rank 0, blocked in the target's all-gather (FSDP2's hooks, or the packed forward's own gathers),
    names it and exits 3 well within 60 s; the run then continues from its last checkpoint."""
    root, cfg = setup
    out = root / f"killed-{forward}"
    procs = _direct(cfg, out, 2, "--pipeline.layout", "colocated", *GROUP2, "--run.max_steps", "100000",
                    "--run.log_every", "1", "--pipeline.heartbeat_s", "0.5", "--pipeline.dead_rank_timeout_s", "4",
                    "--target.forward", forward)
    _wait_for_checkpoint(out)
    os.kill(procs[1].pid, signal.SIGKILL)
    killed = time.time()
    output = finish(procs[0], 60)
    assert procs[0].returncode == 3, output[-3000:]
    assert "rank 1 sent no heartbeat for 4s" in output, output[-3000:]
    assert time.time() - killed < 60
    step = int(latest_checkpoint(out / "checkpoints").name.split("-")[1])
    resumed = run(cfg, out, 2, *GROUP2, "--run.max_steps", str(step + 2), "--resume", "--target.forward", forward)
    assert "resumed from" in resumed and f"(step {step}," in resumed
    assert max(losses(out)) == step + 2
