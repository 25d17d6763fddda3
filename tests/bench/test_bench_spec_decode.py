"""bench/bench_spec_decode.py: the CPU smoke run end to end, and the batched table's arithmetic."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from .scripts import load_script

bench_spec_decode = load_script("bench/bench_spec_decode.py")


def test_cpu_smoke_run_is_lossless_and_fills_both_tables(tmp_path):
    out = tmp_path / "b.json"
    r = bench_spec_decode.main(["preset:tiny", "--random-drafter", "--device", "cpu", "--num-prompts", "3",
                                "--max-new-tokens", "24", "--batch-slots", "4", "--batch-prompts", "6",
                                "--out", str(out)])
    assert out.exists()
    b1, bt = r["batch1"], r["batched"]
    assert b1["lossless"] == {"identical": 3, "near_tie": 0, "mismatch": 0}
    assert b1["greedy"]["tokens"] == b1["spec"]["tokens"] == 3 * 24
    assert b1["speedup_over_tau"] == round(b1["speedup"] / b1["spec"]["tau"], 3)
    assert bt["slots"] == 4 and bt["greedy"]["prompts"] == bt["spec"]["prompts"] == 6
    assert bt["greedy"]["same_as_batch1_greedy"] == bt["spec"]["same_as_batch1_greedy"] == 1.0
    assert bt["speedup_over_tau"] == round(bt["speedup"] / bt["spec"]["tau"], 3)


class _Engine:
    """Two rows of 11 tokens in 4 slots: greedy in 10 rounds each, speculative in 4 (tau (22 - 2)
    / 8 = 2.5); the engine launches one round more than a row needs (the pipelined last one).
    Each launched round takes `ms_per_round` of `clock`, so every timed value is exact."""

    slots = 4

    def __init__(self, clock: "_Clock", ms_per_round: dict[bool, float]):
        self.rounds_launched, self.clock, self.ms_per_round = 0, clock, ms_per_round

    def generate_batch(self, ids, max_new, speculative):
        rounds = 4 if speculative else 10
        self.rounds_launched += rounds + 1
        self.clock.now += (rounds + 1) * self.ms_per_round[speculative] / 1e3
        return [SimpleNamespace(tokens=list(range(11)), rounds=[None] * rounds) for _ in ids]


class _Clock:
    """time.perf_counter as the bench reads it: it moves only when the fake engine runs."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_batched_speedup_is_divided_by_the_speculative_tau(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(bench_spec_decode.time, "perf_counter", clock)
    prompts = [("a", [1, 2]), ("b", [3, 4])]  # (name, ids), as prompt_ids gives them
    engine = _Engine(clock, {False: 2.0, True: 5.0})  # greedy 11 rounds x 2 ms, speculative 5 x 5 ms
    out = bench_spec_decode.batched(engine, prompts, 11, torch.device("cpu"), {(1, 2): list(range(11))})
    assert out["spec"]["tau"] == 2.5 and out["greedy"]["tau"] == 1.0
    assert out["spec"]["same_as_batch1_greedy"] == 1.0  # the one prompt with a reference
    assert (out["greedy"]["seconds"], out["spec"]["seconds"]) == (0.022, 0.025)
    assert (out["greedy"]["committed_tok_s"], out["spec"]["committed_tok_s"]) == (1000.0, 880.0)
    assert out["speedup"] == 0.88 and out["speedup_over_tau"] == round(0.88 / 2.5, 3) == 0.352
    assert (out["spec"]["engine_rounds"], out["greedy"]["engine_rounds"]) == (5, 11)
    assert out["spec"]["slot_use"] == round(8 / (5 * 4), 4) and out["greedy"]["slot_use"] == round(20 / (11 * 4), 4)
    assert (out["greedy"]["ms_per_engine_round"], out["spec"]["ms_per_engine_round"]) == (2.0, 5.0)
