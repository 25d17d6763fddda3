"""The distributed pipeline on CPU: real torchrun processes talking over gloo."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dflash_train.drafter.checkpoint import load_drafter
from dflash_train.train.checkpoint import latest_checkpoint

from ..conftest import prepare_dataset, synthetic_conversations


@pytest.fixture(scope="module")
def setup(tiny_targets, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    data = prepare_dataset(tiny_targets["llama"], synthetic_conversations(300, seed=1), root / "data")
    cfg = {
        "target": {"path": str(tiny_targets["llama"])},
        "data": {"path": str(data), "plan": {"token_budget": 512}},
        "drafter": {"num_layers": 2, "block_size": 4},
        "step": {"num_anchors": 32, "noise_sigma": 0.05},
        "optim": {"lr": 0.003, "warmup_steps": 2},
        "run": {"max_steps": 8, "log_every": 1, "save_every": 4, "progress": False, "tensorboard": False,
                "device": "cpu"},  # gloo runs (conftest.ON_CPU)
    }
    path = root / "base.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return root, path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config: Path, out: Path, nproc: int, *extra: str, env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--standalone",
           "-m", "dflash_train", "train", "--config", str(config), "--run.output_dir", str(out), *extra]
    # a rank that aborts (SIGABRT, SIGSEGV) prints every thread's Python stack into the output
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    return popen(cmd, env)


STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def no_job_outlives_its_test():
    """A test that fails while its job runs leaves no ranks behind to load the next tests."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def popen(cmd: list[str], env: dict) -> subprocess.Popen:
    """A job in its own process group, so that `finish` and the fixture above can end it with
    every rank it started."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    STARTED.append(proc)
    return proc


def finish(proc: subprocess.Popen, timeout: float) -> str:
    """The job's output once it exits. One that has not exited after `timeout` seconds is a hang:
    its whole process group is killed (no rank lives on to slow the next test) and the test fails
    with the job's last output, which says where it stopped."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output = proc.communicate()[0]
        pytest.fail(f"no exit within {timeout:.0f} s (killed); its last output:\n{output[-3000:]}")


def failure_text(output: str) -> str:
    """What a failed job's output says: its tail, and from a fatal error (PYTHONFAULTHANDLER)
    the stacks of every thread, which sit before the tail."""
    fatal = output.find("Fatal Python error")
    return (output[fatal:fatal + 6000] + "\n...\n" if fatal >= 0 else "") + output[-3000:]


def run(config, out, nproc, *extra, timeout=240, env: dict | None = None) -> str:
    proc = launch(config, out, nproc, *extra, env=env)
    output = finish(proc, timeout)
    assert proc.returncode == 0, failure_text(output)
    return output


def single(config, out, *extra) -> str:
    proc = subprocess.run([sys.executable, "-m", "dflash_train", "train", "--config", str(config), "--run.output_dir",
                           str(out), *extra], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def losses(out: Path) -> dict[int, float]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


SPLIT_11 = ("--pipeline.layout", "split", "--pipeline.target_ranks", "1", "--pipeline.drafter_ranks", "1")
SPLIT_22 = ("--pipeline.layout", "split", "--pipeline.target_ranks", "2", "--pipeline.drafter_ranks", "2")


def test_split_1_plus_1_matches_single_process(setup):
    root, cfg = setup
    single(cfg, root / "single")
    run(cfg, root / "split11", 2, *SPLIT_11)
    assert losses(root / "split11") == pytest.approx(losses(root / "single"), rel=1e-5)
    a, b = load_drafter(root / "single" / "final"), load_drafter(root / "split11" / "final")
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_init_from_target_under_torchrun_split_equals_single_process(setup):
    """drafter.init_from_target: a split layout's drafter rank (no target) reads the layers from the
    target's files and trains exactly like one process, which copies them from the loaded target
    (as colocated ranks do: the single-process path)."""
    root, cfg = setup
    init = ("--drafter.init_from_target", "spread", "--run.max_steps", "4")
    err = single(cfg, root / "init-single", *init)
    assert "drafter layers start as target layers [1, 4]" in err
    out = run(cfg, root / "init-split11", 2, *SPLIT_11, *init)
    assert "drafter layers start as target layers [1, 4]" in out
    assert losses(root / "init-split11") == pytest.approx(losses(root / "init-single"), rel=1e-5)


def test_split_2_plus_2_consumes_every_batch_once_and_matches_colocated(setup):
    root, cfg = setup
    from dflash_train.data.batching import BatchPlanConfig, BatchPlanner
    from dflash_train.data.dataset import TokenDataset

    one_epoch = ("--run.epochs", "1", "--run.max_steps", "null", "--data.plan.drop_last", "true")
    out = run(cfg, root / "split22", 4, *SPLIT_22, *one_epoch)
    # the batches of epoch 0 that two consumers share (drop_last: an odd last batch is left out)
    plan = BatchPlanner(TokenDataset(yaml.safe_load(cfg.read_text())["data"]["path"]).lengths,
                        BatchPlanConfig(token_budget=512, drop_last=True)).plan(0)
    expected = [s for b in range(2 * (len(plan) // 2)) for row in plan[b] for s in row]
    stats = json.loads((root / "split22" / "pipeline_stats.json").read_text())
    drafters = [r for r in stats["ranks"] if r["role"] == "drafter"]
    targets = [r for r in stats["ranks"] if r["role"] == "target"]
    assert len(drafters) == 2 and len(targets) == 2
    # each of those batches trained on exactly once across the drafters
    assert len(set(expected)) == len(expected) > 250
    assert sum(r["samples"] for r in drafters) == len(expected)
    assert sum(r["sample_id_sum"] for r in drafters) == sum(expected)
    assert sum(r["sample_id_sq_sum"] for r in drafters) == sum(i * i for i in expected)
    assert sum(r["batches"] for r in targets) == sum(r["batches"] for r in drafters)
    assert "bottleneck:" in out
    # colocated on 2 ranks trains the same two shares with the same seeds: same losses
    run(cfg, root / "colocated2", 2, *one_epoch)
    assert losses(root / "colocated2") == pytest.approx(losses(root / "split22"), rel=1e-5)


def _rank_pid(launcher: subprocess.Popen, rank: int, timeout: float = 60) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                stat = Path(f"/proc/{pid}/stat").read_text().split()
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and "TORCHELASTIC_RUN_ID".encode() in b" ".join(env) \
                    and int(stat[3]) == launcher.pid:
                return int(pid)
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} process not found")


def _wait_for_checkpoint(out: Path, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while latest_checkpoint(out / "checkpoints") is None:
        assert time.time() < deadline, "no checkpoint appeared"
        time.sleep(0.2)


def test_killed_target_rank_fails_the_whole_job_quickly(setup):
    root, cfg = setup
    out = root / "killed"
    proc = launch(cfg, out, 2, *SPLIT_11, "--run.max_steps", "100000", "--run.log_every", "100",
                  "--pipeline.dead_rank_timeout_s", "4", "--pipeline.heartbeat_s", "0.5")
    _wait_for_checkpoint(out)
    os.kill(_rank_pid(proc, 0), signal.SIGKILL)
    killed_at = time.time()
    output = finish(proc, 90)
    assert proc.returncode != 0
    assert time.time() - killed_at < 60
    assert "Signal 9 (SIGKILL)" in output and "rank      : 0" in output


def test_sigterm_on_a_target_rank_leaves_a_resumable_checkpoint(setup):
    root, cfg = setup
    out = root / "term"
    proc = launch(cfg, out, 2, *SPLIT_11, "--run.max_steps", "100000", "--run.log_every", "100",
                  "--run.save_every", "100000")
    time.sleep(1)
    _wait_for_checkpoint_or_steps(proc, out)
    os.kill(_rank_pid(proc, 0), signal.SIGTERM)
    output = finish(proc, 90)
    assert proc.returncode == 0, output[-3000:]
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt is not None and "continue with --resume" in output
    step = json.loads((ckpt / "state.json").read_text())["train_state"]["step"]
    resumed = run(cfg, out, 2, *SPLIT_11, "--run.max_steps", str(step + 3), "--resume")
    assert f"resumed from {ckpt}" in resumed
    assert max(losses(out)) == step + 3


def _wait_for_checkpoint_or_steps(proc, out: Path, timeout: float = 120) -> None:
    """Wait until training is under way (metrics are being written)."""
    deadline = time.time() + timeout
    while not (out / "metrics.jsonl").is_file() or not (out / "metrics.jsonl").read_text().strip():
        assert time.time() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.2)


# -- stops and faults on several ranks -------------------------------------------------------------


def _wait_for_steps(proc, out: Path, steps: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not (out / "metrics.jsonl").is_file() or len(losses(out)) < steps:
        assert time.time() < deadline and proc.poll() is None, "training did not get under way"
        time.sleep(0.1)


def test_sigterm_to_torchrun_saves_one_checkpoint_and_resume_equals_the_uninterrupted_run(setup):
    """torchrun forwards SIGTERM to every rank: they agree on a step, one checkpoint is written,
    all exit well within torchrun's 30 s grace, and the resumed run's losses are the
    uninterrupted run's, step for step."""
    root, cfg = setup
    steps = ("--run.max_steps", "120", "--run.save_every", "100000")
    out = root / "term_all"
    proc = launch(cfg, out, 2, *steps)
    _wait_for_steps(proc, out, 3)
    proc.send_signal(signal.SIGTERM)  # to torchrun itself
    sent = time.time()
    output = finish(proc, 90)
    assert time.time() - sent < 20, output[-3000:]
    assert proc.returncode == 1, output[-3000:]  # torchrun's own code when it was signalled (docs/training.md)
    assert "Sending process" in output and "stopped by SIGTERM: continue with --resume" in output
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(saved) == 1, saved
    step = json.loads((out / "checkpoints" / saved[0] / "state.json").read_text())["train_state"]["step"]
    assert 3 <= step < 120
    resumed = run(cfg, out, 2, *steps, "--resume")
    assert f"(step {step}," in resumed
    run(cfg, root / "term_ref", 2, *steps)
    got, ref = losses(out), losses(root / "term_ref")
    assert sorted(got) == sorted(ref) == list(range(1, 121))
    assert got == ref  # exact: same batches, same seeds, same reductions


def _direct(config: Path, out: Path, n: int, *extra: str) -> list[subprocess.Popen]:
    """n ranks started without torchrun, as `srun` starts them: nobody but the ranks
    themselves can end the survivors of a dead rank."""
    port = _free_port()
    procs = []
    for r in range(n):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(n), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(n),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        procs.append(popen([sys.executable, "-m", "dflash_train", "train", "--config", str(config),
                            "--run.output_dir", str(out), *extra], env))
    return procs


@pytest.mark.parametrize("layout, victim, how", [
    ("colocated", 1, signal.SIGSTOP),  # frozen: its sockets stay open, the survivor's collective never fails
    ("split", 2, signal.SIGKILL),  # a drafter of a 1 + 2 split: its target and the other drafter survive
])
def test_the_survivors_of_a_dead_rank_name_it_and_exit_3(setup, layout, victim, how):
    root, cfg = setup
    out = root / f"dead_{layout}"
    layout_args = ("--pipeline.layout", "colocated") if layout == "colocated" else (
        "--pipeline.layout", "split", "--pipeline.target_ranks", "1", "--pipeline.drafter_ranks", "2")
    n = 2 if layout == "colocated" else 3
    procs = _direct(cfg, out, n, *layout_args, "--run.max_steps", "100000", "--run.log_every", "1",
                    "--run.save_every", "100000", "--pipeline.timeout_s", "600", "--pipeline.heartbeat_s", "0.5",
                    "--pipeline.dead_rank_timeout_s", "4")
    _wait_for_steps(procs[0], out, 3)
    os.kill(procs[victim].pid, how)  # the frozen one is killed after the test (no_job_outlives_its_test)
    hit = time.time()
    for r, p in enumerate(procs):
        if r == victim:
            continue
        output = finish(p, 60)
        assert p.returncode == 3, (r, output[-3000:])
        assert f"rank {victim} sent no heartbeat for 4s" in output, output[-3000:]
    assert time.time() - hit < 30


def test_two_torchrun_agents_as_two_nodes_run_split_and_colocated(setup):
    """Two torchrun agents on this host as two nodes (c10d rendezvous), as on two machines."""
    root, cfg = setup
    for name, layout in (("nodes_split", SPLIT_11), ("nodes_colocated", ("--pipeline.layout", "colocated"))):
        port, procs = _free_port(), []
        for _ in range(2):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={name}",
                   "-m", "dflash_train", "train", "--config", str(cfg), "--run.output_dir", str(root / name), *layout]
            env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
            procs.append(popen(cmd, env))
        outputs = [finish(p, 240) for p in procs]
        assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
        assert sorted(losses(root / name)) == list(range(1, 9))
    # the same two shares of the data either way: split 1+1 trains what a single process does
    single(cfg, root / "nodes_single")
    assert losses(root / "nodes_split") == pytest.approx(losses(root / "nodes_single"), rel=1e-5)


def test_fit_schedule_under_torchrun_ends_both_replicas_at_one_step(setup):
    """run.fit_schedule with a time box far shorter than max_steps, two colocated replicas: each
    measures its own rate and they take the smaller count. Were each to keep its own, the one that
    ends first would leave the other hanging in its next gradient all-reduce (the run would fail or
    time out). The box may still end the run before the fitted step (CPU rates drift by more than
    the 5% margin, more so on a loaded machine), on both replicas alike, and then it says so."""
    root, cfg = setup
    out = run(cfg, root / "fit", 2, "--run.max_steps", "100000", "--run.max_minutes", "0.1",
              "--run.fit_schedule", "true", "--run.log_every", "2", "--run.save_every", "100000", timeout=90)
    # the first fit, then any refit a moved rate asked for (the replicas agree on each: the slowest count)
    fits = [(m.group(1), int(m.group(2).replace(",", ""))) for m in
            re.finditer(r"schedule (fitted|refitted) to run\.max_minutes=0\.1: ([\d,]+) steps", out)]
    assert fits and fits[0][0] == "fitted" and all(v == "refitted" for v, _ in fits[1:]), out[-3000:]
    fitted = fits[-1][1]  # the schedule the run ended on
    last = int(latest_checkpoint(root / "fit" / "checkpoints").name.split("-")[1])  # the final step
    assert 4 < fitted < 100000 and last <= fitted, (fits, last)
    assert last == fitted or f"stopped at step {last} of {fitted}: run.max_minutes=0.1" in out, out[-1500:]
    assert (root / "fit" / "final" / "model.safetensors").is_file()


# The same jobs on a GPU (skipped without one): two processes on GPU 0 alone.
ONE_GPU = {"CUDA_VISIBLE_DEVICES": "0"}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@needs_gpu
def test_gpu_split_1_plus_1_sharing_one_gpu_trains(setup):
    """A target rank and a drafter rank on one GPU: NCCL refuses two ranks of one communicator on
    one device, so the job starts without binding it (no eager NCCL communicator) and the hidden
    states go through host memory; the tiny drafter's 8-dim heads take the dense mask."""
    root, cfg = setup
    out = run(cfg, root / "gpu-split11", 2, *SPLIT_11, "--run.device", "cuda", env=ONE_GPU)
    assert sorted(losses(root / "gpu-split11")) == list(range(1, 9)), out[-3000:]
    assert all(loss == loss for loss in losses(root / "gpu-split11").values())  # finite, not NaN
    assert "heads of 8 dims: the dense attention mask" in out


@needs_gpu
def test_gpu_two_drafters_on_one_gpu_are_refused_at_start(setup):
    """Two colocated ranks on one GPU would all-reduce gradients over NCCL with two ranks on one
    device: refused before the process group starts, naming the ranks and the way out."""
    root, cfg = setup
    started = time.monotonic()
    proc = launch(cfg, root / "gpu-colocated2", 2, "--pipeline.layout", "colocated", "--run.device", "cuda",
                  env=ONE_GPU)
    output = finish(proc, 120)
    assert proc.returncode != 0 and time.monotonic() - started < 120
    assert "drafter ranks 0, 1 would share cuda:0" in output and "--nproc-per-node 1" in output, output[-3000:]
    assert not (root / "gpu-colocated2" / "checkpoints").exists()


@needs_gpu
def test_gpu_visible_cpu_run_never_creates_a_cuda_context(setup):
    """A CPU run on a GPU machine (these tests' runs) leaves the GPU alone, checkpoints included:
    were each rank to create a CUDA context (seconds and ~0.5 GB each, all ranks at once on one
    GPU), a CPU job would slow down or fail where the GPU is busy or exclusive."""
    root, cfg = setup
    out = root / "cpu-on-gpu-machine"
    code = ("import sys, torch\nfrom dflash_train.cli import main\n"
            f"rc = main(['train', '--config', {str(cfg)!r}, '--run.output_dir', {str(out)!r}])\n"
            "print('CUDA initialised:', torch.cuda.is_initialized())\nsys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CUDA initialised: False" in proc.stdout and latest_checkpoint(out / "checkpoints") is not None
