"""`generate --batch-size auto` fits the KV cache to the device (generate/sizing.py), a batch that
cannot fit is one line before any memory is taken, and what a run leaves and prints is clear."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import dflash_train.generate.sizing as sizing
import dflash_train.generate.job as job
from dflash_train.cli import main
from dflash_train.generate.sizing import KvShape, auto_slots, cache_positions, kv_shape, too_big

GiB = 2**30
# SmolLM2-135M's cache in float32 on a CPU: 30 layers x 3 kv heads x 64 dims, 2,176 positions (2,048 + 96)
SMOLLM2 = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                          head_dim=64)


def test_one_slot_of_the_cache_is_what_the_engine_allocates():
    shape = kv_shape(SMOLLM2, cache_positions(2048, 96, "dense"), torch.float32)
    assert (shape.positions, shape.head_dim) == (2176, 64)
    assert shape.bytes_per_slot == 2 * 30 * 3 * 2176 * 64 * 4 == 100_270_080  # 64 slots: the 5.98 GiB of before
    assert cache_positions(2048, 96, "flex") == 2176 and cache_positions(2048, 129, "flex") == 2176 + 128
    assert cache_positions(2048, 129, "dense") == 2176 + 64
    no_head_dim = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)  # MHA, derived dims
    assert kv_shape(no_head_dim, 10, torch.bfloat16) == KvShape(2, 4, 16, 10, 2)


def test_auto_takes_half_the_hosts_available_memory_on_a_cpu_and_at_most_64_slots():
    shape = kv_shape(SMOLLM2, 2176, torch.float32)
    laptop = auto_slots(shape, torch.device("cpu"), free=5 * GiB)  # an 8 GB laptop with a browser open
    assert laptop.slots == 2.5 * GiB // shape.bytes_per_slot == 26
    assert laptop.kv_bytes == 26 * shape.bytes_per_slot <= 2.5 * GiB
    assert laptop.why == "2.50 GiB budget, half of the host's available memory"
    assert auto_slots(shape, torch.device("cpu"), free=100 * GiB).slots == 64
    assert auto_slots(shape, torch.device("cpu"), free=100 * GiB).why.endswith("; capped at 64")
    assert auto_slots(shape, torch.device("cpu"), free=GiB // 10).slots == 1  # never 0: one slot at least


def test_auto_takes_the_gpus_free_memory_less_a_reserve_and_at_most_1536_slots():
    bf16 = kv_shape(SMOLLM2, 3072, torch.bfloat16)  # 70.8 MB a slot
    h200 = auto_slots(bf16, torch.device("cuda"), free=139 * GiB)
    assert h200.slots == 1536 and h200.why.endswith("capped at 1536")
    qwen3_8b = kv_shape(SimpleNamespace(num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                        hidden_size=4096, head_dim=128), 3072, torch.bfloat16)
    after_weights = auto_slots(qwen3_8b, torch.device("cuda"), free=123 * GiB)
    budget = 123 * GiB - int(0.1 * 123 * GiB)
    assert after_weights.slots == budget // qwen3_8b.bytes_per_slot == 262 and after_weights.budget_bytes == budget


def test_a_cache_larger_than_the_device_is_one_line_with_its_size():
    shape = kv_shape(SMOLLM2, 2176, torch.float32)
    assert too_big(64, shape, 7 * GiB, "the host's available memory") is None
    assert too_big(10**9, shape, 8 * 10**9, "the host's available memory") == (
        "--batch-size 1,000,000,000 needs a KV cache of 100,270.1 TB (1,000,000,000 slots x 2,176 positions x 30 "
        "layers), and the host's available memory is 8.0 GB: use --batch-size auto (it fits the cache to the "
        "memory), fewer slots, or a lower --max-prompt-tokens / --max-new-tokens")


def _generate(model_dir, prompts, out, *extra) -> list[str]:
    return ["generate", "--target", str(model_dir), "--prompts", str(prompts), "--output", str(out), "--device",
            "cpu", "--max-new-tokens", "4", "--max-prompt-tokens", "64", "--no-progress", *extra]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"count to {i}", "response": "x"}) + "\n" for i in range(6)))
    return path


def test_a_batch_that_cannot_fit_is_refused_before_the_model_loads_and_leaves_no_output(model_dir, prompts, tmp_path,
                                                                                         monkeypatch, capsys):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(job, "load_causal_lm", refuse)
    monkeypatch.setattr(sizing, "host_available_bytes", lambda: 8 * 10**9)
    out = tmp_path / "gen.jsonl"
    assert main(_generate(model_dir, prompts, out, "--batch-size", "1000000000")) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("dflash-train generate: error: --batch-size 1,000,000,000 needs a "
                                                   "KV cache of ")
    assert "Traceback" not in err and not out.exists()  # the file this run created, still empty, is removed


def test_auto_says_what_it_took_and_the_engine_runs_that_many_slots(model_dir, prompts, tmp_path, monkeypatch, capsys):
    shape_seen = {}
    real_auto = job.auto_slots

    def small_host(shape, device, free):
        shape_seen["bytes"] = shape.bytes_per_slot
        return real_auto(shape, device, free)

    monkeypatch.setattr(job, "auto_slots", small_host)
    # what three slots of this tiny model need, as the host's available memory: half of it holds one
    per_slot = kv_shape(json.loads((model_dir / "config.json").read_text(), object_hook=lambda d: SimpleNamespace(**d)),
                        cache_positions(64, 4, "dense"), torch.float32).bytes_per_slot
    monkeypatch.setattr(sizing, "host_available_bytes", lambda: 3 * per_slot)
    out = tmp_path / "gen.jsonl"
    assert main(_generate(model_dir, prompts, out)) == 0
    err = capsys.readouterr().err
    assert shape_seen["bytes"] == per_slot
    assert (f"batch size auto: 1 slots x 128 positions, KV cache {per_slot / GiB:.2f} GiB "
            f"({1.5 * per_slot / GiB:.2f} GiB budget, half of the host's available memory)") in err
    assert "built-in engine: 1 slots x 128 positions" in err
    assert len(out.read_text().splitlines()) == 6


def test_the_summary_is_a_few_lines_and_json_on_request(model_dir, prompts, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", [".venv/bin/dflash-train", "generate"])  # how the next command is spelled
    out = tmp_path / "gen.jsonl"
    assert main(_generate(model_dir, prompts, out, "--batch-size", "2")) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[0].startswith(f"wrote 6 conversations to {out} (0 there before), 24 new tokens in ")
    assert printed[1].startswith("engine: ")
    assert printed[1].endswith("of the slots busy (--summary json: every counter)")
    assert printed[2:] == [f"next: .venv/bin/dflash-train prepare {out} --target {model_dir} --output DATA_DIR"]
    assert main(_generate(model_dir, prompts, tmp_path / "again.jsonl", "--batch-size", "2", "--summary", "json")) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["written"] == 6 and summary["engine_stats"]["decode_steps"] > 0


def test_an_output_written_with_other_settings_is_refused_naming_them(model_dir, prompts, tmp_path, capsys):
    out = tmp_path / "gen.jsonl"
    assert main(_generate(model_dir, prompts, out, "--batch-size", "2")) == 0
    before = out.read_bytes()
    capsys.readouterr()
    assert main(_generate(model_dir, prompts, out, "--batch-size", "2", "--max-new-tokens", "6",
                          "--temperature", "0.5")) == 2
    assert capsys.readouterr().err.strip() == (
        f"dflash-train generate: error: {out}: its 6 rows were written with other settings (temperature: 0.0 there "
        f"vs 0.5 now; max_new_tokens: 4 there vs 6 now): rerun with those settings to resume, choose another "
        f"--output, or pass --append-other-settings to mix them in one file")
    assert out.read_bytes() == before
    assert main(_generate(model_dir, prompts, out, "--batch-size", "2", "--max-new-tokens", "6")) == 2
    assert main(_generate(model_dir, prompts, out, "--batch-size", "2", "--max-new-tokens", "6",
                          "--append-other-settings")) == 0  # asked for: appended (every row is done: none here)
    assert "appending with other settings than its rows' (max_new_tokens: 4 there vs 6 now)" in capsys.readouterr().err
    assert main(_generate(model_dir, prompts, out, "--batch-size", "2", "--seed", "7")) == 0  # greedy: seed is moot
